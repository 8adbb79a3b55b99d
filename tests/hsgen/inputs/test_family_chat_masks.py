"""Each verifier family's published chat template renders with an assistant-only loss mask.

The templates are the models' own (``tests/data/chat_templates/``, sources in its README); each
family gets a BPE tokenizer trained in code with that family's special tokens, so the markers
tokenize as they do in the real tokenizer. A multi-turn chat with a system turn goes through
``render_stream`` (what ``hsgen generate`` and ``hsgen render`` call), and the masked tokens must
decode to exactly what the verifier generates in each assistant turn: everything after the
generation prompt through the end-of-turn token, nothing of the system or user turns, not the
newline a template writes after the end-of-turn token. The expected spans are written out by
hand from each format, not derived from the renderer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from hsgen.inputs.render import ChatRenderer, RenderConfig, render_stream

TEMPLATES = Path(__file__).resolve().parents[2] / "data" / "chat_templates"

SYSTEM = {"role": "system", "content": "Be brief."}
FIRST_USER = {"role": "user", "content": "Reply with 4. and stop."}
SECOND_USER = {"role": "user", "content": "And 3+3?"}


def chat(first: dict[str, Any] | None = None, second: dict[str, Any] | None = None, system: bool = True):
    """System (optional), a user turn quoting the reply it asks for, the reply, a user turn, a reply."""
    return [SYSTEM] * system + [
        FIRST_USER,
        {"role": "assistant", "content": "4.", **(first or {})},
        SECOND_USER,
        {"role": "assistant", "content": "6, obviously.", **(second or {})},
    ]


@dataclass(frozen=True)
class TemplateCase:
    name: str
    template: str
    special: tuple[str, ...]
    names: dict[str, str]
    messages: list[dict[str, Any]]
    expected: tuple[str, ...]
    """What the masked tokens decode to, one string per assistant turn."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    dropped: tuple[str, ...] = ()
    """Non-assistant contents the template itself leaves out."""


_LLAMA = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
          "<|eom_id|>", "<|python_tag|>")  # fmt: skip
_CHATML = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")
_QWEN3 = _CHATML + ("<think>", "</think>", "<tool_response>", "</tool_response>")
_GEMMA = ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>")
_GEMMA4 = ("<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|think|>", "<|tool>",
           "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>',
           "<|image|>", "<|audio|>", "<|video|>")  # fmt: skip
_HARMONY = ("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
            "<|constrain|>", "<|return|>", "<|call|>")  # fmt: skip
_MISTRAL = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]")  # fmt: skip
_PLAIN = ("4.<|eot_id|>", "6, obviously.<|eot_id|>")

CASES = (
    TemplateCase(
        "llama3",
        "meta-llama-Llama-3.1-8B-Instruct.jinja",
        _LLAMA,
        dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"),
        chat(),
        _PLAIN,
    ),
    TemplateCase(
        "mistral",
        "mistralai-Mistral-Nemo-Instruct-2407.jinja",
        _MISTRAL,
        dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>"),
        chat(),
        ("4.</s>", "6, obviously.</s>"),
        dropped=("Be brief.",),
    ),  # the system prompt goes into the last turn when it is a user turn, so it is gone here
    TemplateCase(
        "qwen2",
        "Qwen-Qwen2.5-7B-Instruct.jinja",
        _CHATML,
        dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
        chat(),
        ("4.<|im_end|>", "6, obviously.<|im_end|>"),
    ),
    TemplateCase(
        "qwen3_thinking",
        "Qwen-Qwen3-0.6B.jinja",
        _QWEN3,
        dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
        chat({"reasoning_content": "Easy."}, {"reasoning_content": "3+3 is 6."}),
        ("4.<|im_end|>", "<think>\n3+3 is 6.\n</think>\n\n6, obviously.<|im_end|>"),
    ),  # the earlier turn's reasoning is not rendered, so it cannot be trained
    TemplateCase(
        "qwen3_thinking_inline",
        "Qwen-Qwen3-0.6B.jinja",
        _QWEN3,
        dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
        chat(
            {"content": "<think>\nEasy.\n</think>\n\n4."},
            {"content": "<think>\n3+3 is 6.\n</think>\n\n6, obviously."},
        ),
        ("4.<|im_end|>", "<think>\n3+3 is 6.\n</think>\n\n6, obviously.<|im_end|>"),
    ),  # fmt: skip
    TemplateCase(
        "qwen3_no_thinking",
        "Qwen-Qwen3-0.6B.jinja",
        _QWEN3,
        dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"),
        chat(),
        ("4.<|im_end|>", "6, obviously.<|im_end|>"),
        dict(enable_thinking=False),
    ),  # the empty <think></think> is the generation prompt's, not generated
    TemplateCase(
        "gpt_oss",
        "openai-gpt-oss-120b.jinja",
        _HARMONY,
        dict(bos_token="<|startoftext|>", eos_token="<|return|>", pad_token="<|endoftext|>"),
        chat({"thinking": "Easy."}, {"thinking": "3+3 is 6."}),
        (
            "<|channel|>final<|message|>4.<|end|>",
            "<|channel|>analysis<|message|>3+3 is 6.<|end|><|start|>assistant<|channel|>final<|message|>"
            "6, obviously.<|return|>",
        ),
    ),  # the generation prompt is "<|start|>assistant": the channel headers are generated
    TemplateCase(
        "gemma2",
        "google-gemma-2-2b-it.jinja",
        _GEMMA,
        dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"),
        chat(system=False),
        ("4.<end_of_turn>", "6, obviously.<end_of_turn>"),
    ),  # Gemma 2's template refuses a system turn
    TemplateCase(
        "gemma3",
        "google-gemma-3-it.jinja",
        _GEMMA,
        dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"),
        chat(),
        ("4.<end_of_turn>", "6, obviously.<end_of_turn>"),
    ),
    TemplateCase(
        "gemma4",
        "google-gemma-4-it.jinja",
        _GEMMA4,
        dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"),
        chat(),
        ("4.<turn|>", "6, obviously.<turn|>"),
    ),  # the generation prompt's empty thought channel is not in the rendered turns
    TemplateCase(
        "gemma4_thinking",
        "google-gemma-4-it.jinja",
        _GEMMA4,
        dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"),
        chat(),
        ("4.<turn|>", "6, obviously.<turn|>"),
        dict(enable_thinking=True),
    ),
)

CORPUS = [
    "Be brief. Reply with 4. and stop. And 3+3? 6, obviously. Easy. 3+3 is 6.",
    "You are ChatGPT, a large language model trained by OpenAI. Knowledge cutoff: 2024-06",
    "Cutting Knowledge Date: December 2023 Today Date: Reasoning: medium # Valid channels: analysis,",
    "commentary, final. Channel must be included for every message. # Instructions system user model",
] * 4


@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    from hsgen.hf.tiny import build_tokenizer

    root = tmp_path_factory.mktemp("family-tokenizers")
    built: dict[str, Path] = {}

    def get(case: TemplateCase) -> Path:
        if case.name not in built:
            template = (TEMPLATES / case.template).read_text()
            tok = build_tokenizer(
                CORPUS, 400, special_tokens=case.special, chat_template=template, **case.names
            )
            tok.save_pretrained(root / case.name)
            built[case.name] = root / case.name
        return built[case.name]

    return get


def _masked_runs(ids: list[int], mask: list[int], decode) -> list[str]:
    runs: list[list[int]] = []
    for t, (i, m) in enumerate(zip(ids, mask, strict=True)):
        if m:
            if not t or not mask[t - 1]:
                runs.append([])
            runs[-1].append(i)
    return [decode(r) for r in runs]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_family_template_masks_exactly_the_generated_turns(case, tokenizer_dirs, tmp_path):
    from transformers import AutoTokenizer

    tok_dir = tokenizer_dirs(case)
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"id": "c0", "messages": case.messages}) + "\n")
    renderer = ChatRenderer(RenderConfig(tokenizer_path=str(tok_dir), template_kwargs=case.kwargs))
    (prompt,) = list(render_stream([str(data)], renderer))

    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    hf_ids = hf.apply_chat_template(case.messages, tokenize=True, **case.kwargs)
    hf_ids = list(hf_ids["input_ids"] if hasattr(hf_ids, "keys") else hf_ids)
    assert prompt.token_ids == hf_ids, "the ids differ from transformers' apply_chat_template"

    def decode(ids):
        return hf.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    runs = _masked_runs(prompt.token_ids, prompt.loss_mask, decode)
    assert runs == list(case.expected)
    unmasked = decode([t for t, m in zip(prompt.token_ids, prompt.loss_mask, strict=True) if not m])
    for m in case.messages:
        if m["role"] != "assistant" and m["content"] not in case.dropped:
            assert m["content"] in unmasked
    assert not any(d in decode(prompt.token_ids) for d in case.dropped)


@pytest.mark.parametrize("case", [c for c in CASES if c.name in ("mistral", "gemma4")], ids=lambda c: c.name)
def test_a_user_turn_quoting_the_reply_is_not_trained(case, tokenizer_dirs, tmp_path):
    """Where the template's prefixes are not prefixes, the reply is searched after its user turn."""
    renderer = ChatRenderer(
        RenderConfig(tokenizer_path=str(tokenizer_dirs(case)), template_kwargs=case.kwargs)
    )
    ids, mask = renderer.render_messages(case.messages)
    text = renderer.apply_template(case.messages)
    quote = text.index("Reply with 4.")
    _, offsets = renderer.encode(text)
    assert not any(
        m and s < quote + len("Reply with 4. and stop.") and e > quote
        for (s, e), m in zip(offsets, mask, strict=True)
    )


def test_every_template_file_has_its_source_recorded():
    readme = (TEMPLATES / "README.md").read_text()
    files = sorted(p.name for p in TEMPLATES.glob("*.jinja"))
    assert files and all(name in readme for name in files)
    assert {c.template for c in CASES} == set(files)
