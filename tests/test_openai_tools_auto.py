"""tool_choice "auto" through the official `openai` SDK on the real stack (grammar service,
one TP=1 worker, a gateway with its HTTP API, real processes), on a tiny checkpoint whose chat
template is Qwen3's real one (tests/data/tokenizers/qwen3, tools in the Hermes `<tool_call>`
format): the model answers in text or calls a tool in that format, and the calls come back as
`tool_calls`, whole and streamed alike. (tests/test_tool_calls.py runs the same grammar on the
real Qwen3 and Llama 3.1 vocabularies.)

The checkpoint is the embedded default model's tokenizer (4k tokens: the mask kernel, run
interpreted on the CPU, costs ~40x less a step than over Qwen3's 151k) with `<tool_call>` and
`</tool_call>` added as tokens, as Qwen's tokenizers have them. A random model would hardly
ever write `<tool_call>`, so the weights are chosen, not random: every layer's output
projection is zero and every embedding row is the same vector, so each step sees the same
hidden state, and the LM head gives `<tool_call>` and `<|im_end|>` fixed shares of the
probability (0.35 each per step of free text; the other 0.3 spread over the text tokens).
Under the grammar a choice then writes text, calls, or both, depending on its seed: both
branches run in one request.
"""

import json
import shutil
from pathlib import Path

import jsonschema
import openai
import pytest
import torch
import transformers
from conftest import RealSystem
from tokenizers import AddedToken, Tokenizer

from grammar_service.default_model import ensure_default_model

QWEN3 = Path(__file__).parent / "data" / "tokenizers" / "qwen3" / "tokenizer_config.json"
WEATHER = {"type": "object", "properties": {"city": {"enum": ["paris", "oslo", "lima"]}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]
N = 6


def write_model(out: Path) -> Path:
    """The checkpoint described in the module docstring."""
    shutil.copytree(ensure_default_model(), out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t in ("<tool_call>", "</tool_call>")])
    tok.save(str(out / "tokenizer.json"))
    tool_call, im_end = tok.token_to_id("<tool_call>"), tok.token_to_id("<|im_end|>")
    tc = json.loads((out / "tokenizer_config.json").read_text())
    tc["chat_template"] = json.loads(QWEN3.read_text())["chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(tc))
    config = transformers.LlamaConfig.from_pretrained(out)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    hidden, text_ids = config.hidden_size, tok.get_vocab_size()
    with torch.no_grad():
        model.model.embed_tokens.weight.fill_(1.0)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = model.lm_head.weight  # (vocab, hidden); the hidden state is all ones
        head.normal_(0.0, 1.0 / hidden**0.5)  # text logits ~ N(0, 1)
        text = torch.logsumexp(head[:text_ids].sum(1), 0).item()
        for token in (tool_call, im_end):
            head[token] = (text + torch.tensor(0.35 / 0.3).log().item()) / hidden
    (out / "model.safetensors").unlink()
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tools_auto")
    model = write_model(tmp / "qwen3-tools")
    # Qwen3's template spends ~280 of these tokens on the tools' description.
    system = RealSystem(tmp, tp=1, slots=N, model=str(model), max_model_len=512)
    try:
        system.add_gateway("--http-port", "0")
        system.wait_serving(timeout=300)
        yield openai.OpenAI(base_url=system.http_url(0) + "/v1", api_key="unused",
                            max_retries=0, timeout=120)
    finally:
        system.stop()


def _request(client, max_tokens=48, **kw):
    return client.chat.completions.create(
        model=client.models.list().data[0].id, messages=MESSAGES, tools=TOOLS, n=N, seed=11,
        max_tokens=max_tokens, extra_body={"structured_outputs": {"whitespace": "compact"}},
        **kw)


@pytest.fixture(scope="module")
def whole(client):
    # tool_choice left out: "auto", OpenAI's default with tools. One call at most, so a
    # choice that calls ends there (the grammar is complete) instead of calling again.
    return _request(client, parallel_tool_calls=False)


def _check(choice) -> str:
    """"call" or "text": what the choice answered, its calls and fields checked."""
    m = choice.message
    if not m.tool_calls:
        assert isinstance(m.content, str)
        assert choice.finish_reason in ("stop", "length")
        if choice.finish_reason == "stop":  # an unfinished call (length) stays text
            assert "<tool_call>" not in m.content
        return "text"
    for call in m.tool_calls:
        assert call.type == "function" and call.id
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert len({call.id for call in m.tool_calls}) == len(m.tool_calls)
    assert choice.model_extra["schema_valid"] is True
    assert choice.finish_reason in ("tool_calls", "length")
    if choice.finish_reason == "tool_calls":
        assert "<tool_call>" not in (m.content or "")
    return "call"


def test_auto_answers_in_text_or_calls_with_valid_arguments(whole):
    kinds = [_check(c) for c in whole.choices]
    assert set(kinds) == {"call", "text"}, [c.message for c in whole.choices]
    assert any(c.finish_reason == "tool_calls" for c in whole.choices)
    assert all(len(c.message.tool_calls or []) <= 1 for c in whole.choices)


def test_streamed_auto_gives_the_same_content_and_calls(client, whole):
    content = [""] * N
    calls: list[dict] = [{} for _ in range(N)]
    finish = [None] * N
    for chunk in _request(client, parallel_tool_calls=False, stream=True):
        for c in chunk.choices:
            content[c.index] += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                assert tc.id and tc.type == "function"  # each call arrives whole
                calls[c.index][tc.index] = (tc.function.name, tc.function.arguments)
            finish[c.index] = c.finish_reason or finish[c.index]
    for i, c in enumerate(whole.choices):
        expected = [(t.function.name, t.function.arguments)
                    for t in c.message.tool_calls or []]
        assert [calls[i][k] for k in sorted(calls[i])] == expected, i
        assert content[i] == (c.message.content or "") or (
            c.message.content is None and not content[i].strip()), i
        assert finish[i] == c.finish_reason, i


def test_parallel_tool_calls_allow_several_calls(client):
    r = _request(client, tool_choice="auto", max_tokens=96)  # a call is ~25 tokens here
    assert all(_check(c) for c in r.choices)
    assert any(len(c.message.tool_calls or []) >= 2 for c in r.choices), \
        [c.message for c in r.choices]
