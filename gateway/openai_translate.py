"""OpenAI request bodies → GenerateRequests (gateway/openai_responses.py does the way back).

Plain Python (no HTTP): `gateway/openai_api.py` serves it. Every request becomes the
same `GenerateRequest` the gRPC API takes (one per choice), so validation, tokenisation and
compilation are the gateway's one path; this module only translates, and names OpenAI's
field (`param`) in every error, including errors the shared path raises about proto fields.
The sampling fields are checked here, before any choice runs, by the gRPC path's own
`validate_sampling` (the typed `protos.sampling.Sampling`): one set of rules for both APIs;
OpenAI adds only its temperature bound (0–2).

Supported, beyond the plain sampling fields:
- `response_format`: `text`, `json_object`, `json_schema` (`strict` → GrammarOptions.strict).
- `structured_outputs` (extension, in the style of vLLM's): exactly one of `json` (a schema),
  `regex`, `grammar` (EBNF, xgrammar dialect), `choice` (list of strings), `json_object`
  (true), `structural_tag` (object or JSON text); plus `whitespace`
  (`bounded` | `compact` | `any`) for the JSON kinds, and `property_order` for a JSON
  schema from any source: `"schema"` (the default here, as OpenAI's Structured Outputs
  write keys in the schema's order → GrammarOptions.fixed_property_order) or `"any"`.
- `tools` with `tool_choice` `"required"` or `{"type": "function", "function": {"name"}}`:
  the output is the call's arguments under the function's `parameters` schema (one
  candidate function), or, with several candidates, `{"name": ..., "arguments": ...}` under
  an `anyOf` of one object per function. `"none"` generates text. `"auto"` (the default
  with `tools`) needs a chat template whose tool-call format gramserve knows
  (gateway/tool_calls.py): the output is free text or calls in that format, each call's
  arguments under its function's `parameters` (a structural tag); `parallel_tool_calls:
  false` allows at most one call. A template without one is a 400 naming `tool_choice`.
- Extensions mapped 1:1 to SamplingParams: `top_k`, `min_p`, `min_tokens`, `ignore_eos`,
  `stop_token_ids`; `request_timeout` (seconds): the request's deadline (504 past it).
- `logprobs_mode` (extension, with `logprobs`): `"constrained"` (the default: of the
  distribution the token was sampled from, after the grammar's mask) or `"unconstrained"`
  (the model's distribution before the mask) → SamplingParams.logprobs_mode.

Refused with a 400 naming the field, never ignored: `presence_penalty` /
`frequency_penalty` other than 0, `logit_bias`, `functions` /
`function_call`, `audio`, non-text `modalities`, `prediction`, `web_search_options`, and for
completions `echo`, `suffix`, `best_of` other than `n`.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass, field

from gateway.choices import MAX_N, choice_requests
from gateway.tool_calls import ToolFormat, auto_structural_tag
from gateway.tool_calls import tool_format as tool_format_of
from gateway.validation import Limits, validate_sampling
from grammar_service.specs import DEFAULT_MAX_WHITESPACE
from protos import common_pb2, gateway_pb2
from protos.rpc import InvalidArgument
from protos.sampling import LOGPROBS_MODES

_WHITESPACE = {"bounded": common_pb2.WHITESPACE_BOUNDED, "compact": common_pb2.WHITESPACE_COMPACT,
               "any": common_pb2.WHITESPACE_ANY}
_LOGPROBS_MODES = {name: value for value, name in LOGPROBS_MODES.items()}  # name -> enum
_STRUCTURED_KINDS = ("json", "regex", "grammar", "choice", "json_object", "structural_tag")
_REFUSED = {
    "logit_bias": "logit_bias is not supported",
    "functions": "the deprecated `functions` is not supported; use `tools`",
    "function_call": "the deprecated `function_call` is not supported; use `tool_choice`",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
}


class OpenAIError(Exception):
    """An error as an OpenAI error object with its HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type, param, code)
        self.headers = headers or {}  # e.g. Retry-After, WWW-Authenticate

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(param: str | None, message: str) -> OpenAIError:
    """A 400 about `param`."""
    return OpenAIError(400, f"{param}: {message}" if param else message, param=param,
                       code="invalid_value")


@dataclass(frozen=True)
class ToolPlan:
    """How the output becomes tool calls: `format` set (tool_choice "auto") → text and calls
    in the chat template's format, parsed by gateway/tool_calls.py, `schemas` (name → the
    function's `parameters` as JSON text) checks each call's arguments; else `name` set →
    the text is that function's arguments; None → the text is {"name", "arguments"}
    (several candidates)."""

    name: str | None
    format: ToolFormat | None = None
    schemas: dict[str, str] = field(default_factory=dict)


@dataclass
class Plan:
    """One OpenAI request translated: a GenerateRequest per choice and how to answer."""

    endpoint: str  # "chat" or "completion"
    requests: list[gateway_pb2.GenerateRequest]
    prompt_of: list[int]  # completions: the prompt each choice came from
    stream: bool = False
    include_usage: bool = False
    tool: ToolPlan | None = None
    timeout: float | None = None
    # proto field prefix → OpenAI param, for errors raised by the shared path
    params: dict[str, str] = field(default_factory=dict)
    id: str = ""

    def param(self, proto_field: str) -> str:
        """The OpenAI parameter a proto field (`sampling.stop[1]`, ...) came from."""
        if proto_field == "spec" or proto_field.startswith("spec."):  # the grammar service's
            proto_field = "constraint" + proto_field[4:]
        best = ""
        for prefix in self.params:
            if (proto_field == prefix or proto_field.startswith((prefix + ".", prefix + "["))) \
                    and len(prefix) > len(best):
                best = prefix
        return self.params[best] if best else proto_field


# -- requests ----------------------------------------------------------------------------

def _get(body: dict, name: str, types, default=None, *, what: str = ""):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise bad(name, f"must be {what or _names(types)}, got {json.dumps(value)}")
    if not isinstance(value, types):
        raise bad(name, f"must be {what or _names(types)}, got {type(value).__name__}")
    return value


def _names(types) -> str:
    types = types if isinstance(types, tuple) else (types,)
    words = {str: "a string", int: "an integer", float: "a number", bool: "a boolean",
             dict: "an object", list: "an array"}
    return " or ".join(words.get(t, t.__name__) for t in types)


def _refuse_unsupported(body: dict) -> None:
    for name, why in _REFUSED.items():
        value = body.get(name)
        if value not in (None, False, 0, {}):
            raise bad(name, f"{why}; remove the field")
    for name in ("presence_penalty", "frequency_penalty"):
        value = _get(body, name, (int, float), 0)
        if value != 0:
            raise bad(name, f"penalties are not supported; only 0 is accepted, got {value}")
    modalities = body.get("modalities")
    if modalities not in (None, ["text"]):
        raise bad("modalities", 'only ["text"] is supported')


def _set(msg, name: str, value, param: str) -> None:
    """`msg.name = value`, a 400 about `param` when the value does not fit the proto field."""
    try:
        setattr(msg, name, value)
    except (ValueError, TypeError) as exc:
        raise bad(param, f"out of range: {exc}") from None


def _sampling(body: dict, plan: Plan, endpoint: str, limits: Limits) -> common_pb2.SamplingParams:
    """The body's sampling as SamplingParams, checked by validate_sampling: the gRPC path's
    one set of rules (protos/sampling.py), its errors named by the OpenAI param. Only JSON
    types, OpenAI's own spellings and OpenAI's temperature bound are checked here."""
    s = common_pb2.SamplingParams()
    tokens_param = "max_tokens"
    max_tokens = _get(body, "max_tokens", int)
    if endpoint == "chat" and body.get("max_completion_tokens") is not None:
        mct = _get(body, "max_completion_tokens", int)
        if max_tokens is not None and max_tokens != mct:
            raise bad("max_completion_tokens", "differs from max_tokens; send one of them")
        max_tokens, tokens_param = mct, "max_completion_tokens"
    if max_tokens is not None:
        _set(s, "max_tokens", max_tokens, tokens_param)
    plan.params["sampling.max_tokens"] = tokens_param
    for name in ("temperature", "top_p", "min_p"):
        value = _get(body, name, (int, float))
        if value is not None:
            _set(s, name, value, name)
        plan.params[f"sampling.{name}"] = name
    for name in ("top_k", "min_tokens"):
        value = _get(body, name, int)
        if value is not None:
            if name == "top_k" and value == -1:
                value = 0  # vLLM's "off"
            _set(s, name, value, name)
        plan.params[f"sampling.{name}"] = name
    seed = _get(body, "seed", int)
    if seed is not None:
        if not 0 <= seed < 2**64:
            raise bad("seed", f"must be in [0, 2**64), got {seed}")
        s.seed = seed
    plan.params["sampling.seed"] = "seed"
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
            raise bad("stop", "must be a string or an array of strings")
        s.stop.extend(stop)
    plan.params["sampling.stop"] = "stop"
    ids = _get(body, "stop_token_ids", list, [])
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 2**32 for i in ids):
        raise bad("stop_token_ids", "must be an array of token ids")
    s.stop_token_ids.extend(ids)
    plan.params["sampling.stop_token_ids"] = "stop_token_ids"
    s.ignore_eos = bool(_get(body, "ignore_eos", bool, False))
    plan.params["sampling.ignore_eos"] = "ignore_eos"
    if endpoint == "chat":  # logprobs: bool, top_logprobs: 0..20
        s.logprobs = bool(_get(body, "logprobs", bool, False))
        top = _get(body, "top_logprobs", int)
        if top is not None:
            _set(s, "top_logprobs", top, "top_logprobs")
        plan.params["sampling.logprobs"] = "logprobs"
        plan.params["sampling.top_logprobs"] = "top_logprobs"
    else:  # the legacy API: logprobs is the number of alternatives, 0..5
        top = _get(body, "logprobs", int)
        if top is not None:
            if not 0 <= top <= 5:
                raise bad("logprobs", f"must be in [0, 5], got {top}")
            s.logprobs, s.top_logprobs = True, top
        plan.params["sampling.top_logprobs"] = "logprobs"
    mode = _get(body, "logprobs_mode", str)
    if mode is not None:
        if mode not in _LOGPROBS_MODES:
            names = ", ".join(map(json.dumps, _LOGPROBS_MODES))
            raise bad("logprobs_mode", f"must be one of {names}, got {json.dumps(mode)}")
        if _LOGPROBS_MODES[mode] != common_pb2.LOGPROBS_MODE_CONSTRAINED and not s.logprobs:
            raise bad("logprobs_mode", f"{json.dumps(mode)} needs logprobs")
        s.logprobs_mode = _LOGPROBS_MODES[mode]
    plan.params["sampling.logprobs_mode"] = "logprobs_mode"
    try:
        checked = validate_sampling(s, limits)
    except InvalidArgument as exc:
        raise _invalid(exc, plan) from None
    if checked.temperature > 2:  # OpenAI's range; the gRPC API takes any finite value >= 0
        raise bad("temperature", f"must be in [0, 2], got {checked.temperature}")
    return s


def _invalid(exc: InvalidArgument, plan: Plan) -> OpenAIError:
    """The 400 for an InvalidArgument of the shared validation, naming the OpenAI param."""
    message = str(exc)
    if exc.field and message.startswith(f"{exc.field}: "):
        message = message[len(exc.field) + 2:]
    return bad(plan.param(exc.field) if exc.field else None, message)


def _whitespace(options: common_pb2.GrammarOptions, so: dict, plan: Plan) -> None:
    ws = so.get("whitespace")
    if ws is None:
        return
    if ws not in _WHITESPACE:
        raise bad("structured_outputs.whitespace", f"must be one of {', '.join(_WHITESPACE)}")
    options.whitespace = _WHITESPACE[ws]
    plan.params["constraint.options"] = "structured_outputs.whitespace"


def _schema_text(value, param: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise bad(param, f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise bad(param, "must be a JSON Schema object")
    return json.dumps(value)


def _constraint(body: dict, plan: Plan, endpoint: str,
                chat_template: str | None) -> common_pb2.GrammarSpec:
    spec = common_pb2.GrammarSpec()
    rf = _get(body, "response_format", dict)
    so = _get(body, "structured_outputs", dict, {})
    tools = _get(body, "tools", list, []) if endpoint == "chat" else []
    sources = [name for name, present in (
        ("response_format", rf is not None and rf.get("type", "text") != "text"),
        ("structured_outputs", any(k in so for k in _STRUCTURED_KINDS)),
        ("tools", bool(tools) and body.get("tool_choice") != "none")) if present]
    if len(sources) > 1:
        raise bad(sources[1], f"only one constraint per request; {sources[0]} is set too")
    unknown = set(so) - set(_STRUCTURED_KINDS) - {"whitespace", "property_order"}
    if unknown:
        raise bad("structured_outputs", f"unknown field(s) {', '.join(sorted(unknown))}; "
                                        f"known: {', '.join(_STRUCTURED_KINDS)}, whitespace, "
                                        "property_order")
    if rf is not None:
        _response_format(rf, spec, plan)
    if so:
        _structured_outputs(so, spec, plan)
    if endpoint == "chat":
        _tools(body, tools, spec, plan, chat_template)
    if plan.tool is None or plan.tool.format is None:  # "auto" bounds it inside the tag
        _whitespace(spec.options, so, plan)
    _property_order(spec, so, plan)
    return spec


def _property_order(spec: common_pb2.GrammarSpec, so: dict, plan: Plan) -> None:
    """OpenAI's Structured Outputs write an object's keys in the schema's order, so a JSON
    schema here keeps it (GrammarOptions.fixed_property_order) unless the request asks for
    `structured_outputs.property_order: "any"` (JSON Schema's meaning)."""
    order = so.get("property_order", "schema")
    if order not in ("schema", "any"):
        raise bad("structured_outputs.property_order", 'must be "schema" or "any"')
    if "property_order" in so and spec.WhichOneof("kind") != "json_schema":
        raise bad("structured_outputs.property_order", "applies only to a JSON schema")
    if spec.WhichOneof("kind") == "json_schema":
        spec.options.fixed_property_order = order == "schema"
        if "property_order" in so:
            plan.params["constraint.options"] = "structured_outputs.property_order"


def _response_format(rf: dict, spec: common_pb2.GrammarSpec, plan: Plan) -> None:
    kind = rf.get("type")
    if kind == "text":
        return
    if kind == "json_object":
        spec.json_object.SetInParent()
        plan.params["constraint"] = "response_format"
        return
    if kind != "json_schema":
        raise bad("response_format.type", "must be text, json_object or json_schema")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise bad("response_format.json_schema", "must be an object with `schema`")
    if "schema" not in js:
        raise bad("response_format.json_schema.schema", "is required")
    spec.json_schema = _schema_text(js["schema"], "response_format.json_schema.schema")
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad("response_format.json_schema.strict", "must be a boolean")
    spec.options.strict = bool(strict)
    plan.params["constraint"] = "response_format.json_schema.schema"
    plan.params["constraint.options.strict"] = "response_format.json_schema.strict"


def _structured_outputs(so: dict, spec: common_pb2.GrammarSpec, plan: Plan) -> None:
    kinds = [k for k in _STRUCTURED_KINDS if so.get(k) not in (None, False)]
    if len(kinds) > 1:
        raise bad("structured_outputs", f"set one constraint kind, got {' and '.join(kinds)}")
    if not kinds:
        return
    kind = kinds[0]
    param = f"structured_outputs.{kind}"
    value = so[kind]
    plan.params["constraint"] = param
    if kind == "json":
        spec.json_schema = _schema_text(value, param)
    elif kind == "json_object":
        spec.json_object.SetInParent()
    elif kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise bad(param, "must be an array of strings")
        spec.choice.choices.extend(value)
    elif kind == "structural_tag":
        spec.structural_tag = value if isinstance(value, str) else json.dumps(value)
    else:
        if not isinstance(value, str):
            raise bad(param, "must be a string")
        setattr(spec, "regex" if kind == "regex" else "ebnf", value)


def _tools(body: dict, tools: list, spec: common_pb2.GrammarSpec, plan: Plan,
           chat_template: str | None) -> None:
    choice = body.get("tool_choice")
    tool_format = tool_format_of(chat_template)
    if not tools:
        if choice not in (None, "none"):
            raise bad("tool_choice", "needs `tools`")
        return
    if choice == "none":
        return
    if choice is None or choice == "auto":
        if tool_format is None:
            raise bad("tool_choice", '"auto" (the default with `tools`) needs a chat template '
                                     'with a tool-call format gramserve knows (Hermes/Qwen '
                                     '<tool_call>, Llama 3.x JSON); this model\'s has none: '
                                     'send "required", {"type": "function", "function": '
                                     '{"name": ...}} or "none"')
    functions = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(fn, dict):
            raise bad(f"tools[{i}]", 'must be {"type": "function", "function": {...}}')
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad(f"tools[{i}].function.name", "is required")
        if name in functions:
            raise bad(f"tools[{i}].function.name", f"duplicate function {name!r}")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad(f"tools[{i}].function.parameters", "must be a JSON Schema object")
        functions[name] = (i, params, bool(fn.get("strict")))
    if choice is None or choice == "auto":
        _auto_tools(body, functions, tool_format, spec, plan,
                    reasoning="<think>" in (chat_template or ""))
        return
    if choice == "required":
        names = list(functions)
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in functions:
            raise bad("tool_choice.function.name", f"no tool named {name!r} in `tools`")
        names = [name]
    else:
        raise bad("tool_choice", 'must be "none", "auto", "required" or '
                                 '{"type": "function", "function": {"name": ...}}')
    if len(names) == 1:
        i, params, strict = functions[names[0]]
        spec.json_schema = json.dumps(params)
        spec.options.strict = strict
        plan.params["constraint"] = f"tools[{i}].function.parameters"
        plan.tool = ToolPlan(name=names[0])
        return
    spec.json_schema = json.dumps({"anyOf": [
        {"type": "object", "properties": {"name": {"const": n}, "arguments": functions[n][1]},
         "required": ["name", "arguments"], "additionalProperties": False} for n in names]})
    spec.options.strict = all(functions[n][2] for n in names)
    plan.params["constraint"] = "tools"
    plan.tool = ToolPlan(name=None)


def _auto_tools(body: dict, functions: dict, fmt: ToolFormat, spec: common_pb2.GrammarSpec,
                plan: Plan, reasoning: bool) -> None:
    """tool_choice "auto": text or calls in the template's format (a structural tag)."""
    parallel = _get(body, "parallel_tool_calls", bool, True)
    so = body.get("structured_outputs") or {}
    ws = so.get("whitespace", "bounded")
    if ws not in _WHITESPACE:
        raise bad("structured_outputs.whitespace", f"must be one of {', '.join(_WHITESPACE)}")
    # xgrammar's tags bound whitespace runs but cannot forbid them: compact allows one.
    max_ws = {"bounded": DEFAULT_MAX_WHITESPACE, "compact": 1, "any": None}[ws]
    schemas = {name: params for name, (_, params, _) in functions.items()}
    try:
        spec.structural_tag = auto_structural_tag(
            fmt, schemas, parallel=parallel, max_whitespace=max_ws,
            reasoning=reasoning)
    except ValueError as exc:  # xgrammar's checks of the tools (pydantic)
        raise bad("tools", f"cannot build the tool-call grammar: {exc}") from None
    plan.params["constraint"] = "tools"
    plan.tool = ToolPlan(name=None, format=fmt,
                         schemas={n: json.dumps(p) for n, p in schemas.items()})


def _content(value, param: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise bad(f"{param}[{j}]", "only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(param, "must be a string or an array of text parts")


def _messages(body: dict) -> list[gateway_pb2.ChatMessage]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty array")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", "must be an object")
        role = m.get("role")
        if not isinstance(role, str):
            raise bad(f"messages[{i}].role", "is required")
        content = _content(m.get("content"), f"messages[{i}].content")
        if role == "assistant" and m.get("tool_calls") and not content:
            # An earlier call, as the model would have written it under our constraint.
            content = json.dumps([c.get("function") for c in m["tool_calls"]
                                  if isinstance(c, dict)])
        out.append(gateway_pb2.ChatMessage(role="system" if role == "developer" else role,
                                           content=content))
    return out


def _common(body: dict, endpoint: str, limits: Limits, chat_template: str | None = None) -> tuple[
        Plan, int, common_pb2.SamplingParams, common_pb2.GrammarSpec]:
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    _refuse_unsupported(body)
    plan = Plan(endpoint=endpoint, requests=[], prompt_of=[],
                id=("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex)
    n = _get(body, "n", int, 1)
    if not 1 <= n <= MAX_N:
        raise bad("n", f"must be in [1, {MAX_N}], got {n}")
    plan.stream = bool(_get(body, "stream", bool, False))
    so = _get(body, "stream_options", dict, {})
    if so and not plan.stream:
        raise bad("stream_options", "only with stream: true")
    plan.include_usage = bool(so.get("include_usage"))
    timeout = _get(body, "request_timeout", (int, float))
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        raise bad("request_timeout", "must be a number of seconds > 0")
    plan.timeout = timeout
    sampling = _sampling(body, plan, endpoint, limits)
    spec = _constraint(body, plan, endpoint, chat_template)
    plan.params.update({"model": "model", "request": "request"})
    return plan, n, sampling, spec


def _fan_out(plan: Plan, base: gateway_pb2.GenerateRequest, n: int, prompt_index: int) -> None:
    for req in choice_requests(base, n):
        req.request_id = f"{plan.id}-{len(plan.requests)}"
        plan.requests.append(req)
        plan.prompt_of.append(prompt_index)


def chat_plan(body: dict, limits: Limits, chat_template: str | None = None) -> Plan:
    """Translate a /v1/chat/completions body for a gateway of `limits` (its vocabulary bounds
    stop_token_ids) serving a model with `chat_template` (its tool-call format serves
    tool_choice "auto"). Raises OpenAIError (400) naming the field."""
    plan, n, sampling, spec = _common(body, "chat", limits, chat_template)
    base = gateway_pb2.GenerateRequest(model=_model(body), messages=_messages(body),
                                       sampling=sampling, constraint=spec)
    tools = body.get("tools")
    if tools:  # already checked by _constraint; the chat template renders them
        base.tools_json = json.dumps(tools, ensure_ascii=False)
    plan.params.update({"prompt": "messages", "messages": "messages", "tools_json": "tools"})
    _fan_out(plan, base, n, 0)
    return plan


def completion_plan(body: dict, limits: Limits) -> Plan:
    """Translate a /v1/completions body for a gateway of `limits`. Raises OpenAIError (400)
    naming the field."""
    for name in ("echo", "suffix"):
        if isinstance(body, dict) and body.get(name):
            raise bad(name, "is not supported; remove the field")
    plan, n, sampling, spec = _common(body, "completion", limits)
    best_of = _get(body, "best_of", int)
    if best_of is not None and best_of != n:
        raise bad("best_of", "is not supported (only best_of = n)")
    prompts = body.get("prompt")
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                    and all(isinstance(t, int) for t in prompts)):
        prompts = [prompts]
    if not isinstance(prompts, list) or not prompts:
        raise bad("prompt", "must be a string, an array of strings, an array of token ids or "
                            "an array of such arrays")
    if len(prompts) * n > MAX_N:
        raise bad("prompt", f"at most {MAX_N} choices per request (prompts × n)")
    plan.params.update({"prompt": "prompt", "prompt_token_ids": "prompt"})
    for k, p in enumerate(prompts):
        base = gateway_pb2.GenerateRequest(model=_model(body), sampling=sampling, constraint=spec)
        if isinstance(p, str):
            base.prompt = p
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                               and t >= 0 for t in p):
            base.prompt_token_ids.extend(p)
        else:
            raise bad(f"prompt[{k}]", "must be a string or a non-empty array of token ids")
        _fan_out(plan, base, n, k)
    return plan


def _model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "is required")
    return model
