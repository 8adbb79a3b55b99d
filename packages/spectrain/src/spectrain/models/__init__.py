"""Draft model algorithms, one module each, registered by name."""
