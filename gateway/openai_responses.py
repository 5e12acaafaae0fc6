"""Finals → OpenAI response objects, and ServiceErrors → OpenAI error objects.

The other half of gateway/openai_translate.py; plain Python, no HTTP.
"""

from __future__ import annotations

import json
import re

import grpc

from gateway.openai_translate import OpenAIError, Plan, ToolPlan
from gateway.tool_calls import Call
from gateway.tool_calls import parse as parse_calls
from gateway.validation import check_output_against_schema
from protos import common_pb2, gateway_pb2
from protos.rpc import ServiceError

# "field: message", as ServiceError and the grammar service write them.
_FIELD_MESSAGE = re.compile(r"^([A-Za-z_][\w.\[\]]*): (.*)$", re.S)

# -- errors -------------------------------------------------------------------------------

_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_value"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", "failed_precondition"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "queue_full"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error", "unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error", "deadline_exceeded"),
    grpc.StatusCode.CANCELLED: (499, "cancelled", "cancelled"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error", "invalid_api_key"),
}


def from_service_error(exc: ServiceError, plan: Plan | None) -> OpenAIError:
    """The OpenAI error for a ServiceError of the shared path; its proto field becomes the
    OpenAI param (`sampling.top_p: ...` → param `top_p`)."""
    status, kind, code = _STATUS.get(exc.code, (500, "server_error", "internal_error"))
    message = str(exc)
    proto_field = exc.field
    m = _FIELD_MESSAGE.match(message)
    if m and proto_field is None:
        proto_field = m.group(1)
    param = plan.param(proto_field) if proto_field and plan else proto_field
    if m and param:
        message = f"{param}: {m.group(2)}"
    if exc.code == grpc.StatusCode.UNAVAILABLE and "no healthy worker group" in message:
        code = "no_healthy_group"
    if exc.code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAUTHENTICATED):
        param = None
    headers = {}
    if exc.retry_after is not None:
        headers["Retry-After"] = str(max(1, round(exc.retry_after)))
    if exc.code == grpc.StatusCode.UNAUTHENTICATED:
        headers["WWW-Authenticate"] = "Bearer"
    return OpenAIError(status, message, type=kind, param=param, code=code, headers=headers)


# -- responses ----------------------------------------------------------------------------

_ERROR_FINISHES = {common_pb2.FINISH_REASON_ERROR_DEAD_END, common_pb2.FINISH_REASON_ERROR_DIVERGENCE,
                   common_pb2.FINISH_REASON_ERROR_INTERNAL, common_pb2.FINISH_REASON_CANCELLED}


def check_final(final: gateway_pb2.Final) -> None:
    """Raise OpenAIError (500) for a request the worker ended with an error."""
    if final.finish_reason in _ERROR_FINISHES:
        name = common_pb2.FinishReason.Name(final.finish_reason)
        raise OpenAIError(500, f"generation failed ({name}): {final.message}",
                          type="server_error", code=name.lower())


def finish_reason(final: gateway_pb2.Final, tool_calls: list | None) -> str:
    if final.finish_reason == common_pb2.FINISH_REASON_LENGTH:
        return "length"
    return "tool_calls" if tool_calls else "stop"


def tool_calls(text: str, tool: ToolPlan | None, call_id: str) -> list[dict] | None:
    """The tool call the output text encodes, or None when it does not parse as one
    (tool_choice "required" or a named function; "auto" is `auto_message`)."""
    if tool is None or tool.format is not None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if tool.name is not None:
        name, arguments = tool.name, text
    elif isinstance(value, dict) and isinstance(value.get("name"), str) and "arguments" in value:
        name, arguments = value["name"], json.dumps(value["arguments"])
    else:
        return None
    return [{"id": call_id, "type": "function",
             "function": {"name": name, "arguments": arguments}}]


def schema_fields(final: gateway_pb2.Final) -> dict:
    """gramserve's extension fields of a choice: schema_valid (and schema_error)."""
    if not final.HasField("schema_valid"):
        return {}
    out = {"schema_valid": final.schema_valid}
    if not final.schema_valid:
        out["schema_error"] = final.schema_error
    return out


def usage(plan: Plan, finals: list[gateway_pb2.Final]) -> dict:
    """Usage of a whole request: each distinct prompt counted once, every choice's output."""
    prompt = {}
    for i, f in enumerate(finals):
        prompt[plan.prompt_of[i]] = f.usage.prompt_tokens
    p, c = sum(prompt.values()), sum(f.usage.completion_tokens for f in finals)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def call_id(plan: Plan, index: int, k: int = 0) -> str:
    """The id of choice `index`'s call `k`."""
    return f"call_{plan.id[-24:]}_{index}" + (f"_{k}" if k else "")


def call_object(plan: Plan, index: int, k: int, call: Call) -> dict:
    """An OpenAI tool call of choice `index` (its call `k`)."""
    return {"id": call_id(plan, index, k), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def calls_schema_fields(tool: ToolPlan, calls: list[Call]) -> dict:
    """schema_valid (and schema_error) of tool_choice "auto" calls: every call's arguments
    checked against its function's `parameters`; nothing when there is no call."""
    for k, call in enumerate(calls):
        valid, why = check_output_against_schema(tool.schemas[call.name], call.arguments)
        if not valid:
            return {"schema_valid": False, "schema_error": f"tool call {k} ({call.name}): {why}"}
    return {"schema_valid": True} if calls else {}


def auto_message(plan: Plan, index: int, text: str) -> tuple[dict, list[Call]]:
    """The assistant message of a tool_choice "auto" output: its content (None when only
    whitespace surrounds calls) and its `tool_calls` in the template's format."""
    content, calls = parse_calls(plan.tool.format, plan.tool.schemas.keys(), text)
    message = {"role": "assistant",
               "content": None if calls and not content.strip() else content}
    if calls:
        message["tool_calls"] = [call_object(plan, index, k, c) for k, c in enumerate(calls)]
    return message, calls


def chat_choice(plan: Plan, index: int, final: gateway_pb2.Final, token_bytes) -> dict:
    lps = chat_logprobs(plan, index, final.logprobs, token_bytes)
    if plan.tool is not None and plan.tool.format is not None:
        message, calls = auto_message(plan, index, final.text)
        return {"index": index, "message": message, "logprobs": lps,
                "finish_reason": finish_reason(final, calls),
                **calls_schema_fields(plan.tool, calls)}
    calls = tool_calls(final.text, plan.tool, call_id(plan, index))
    message = {"role": "assistant", "content": None if calls else final.text}
    if calls:
        message["tool_calls"] = calls
    return {"index": index, "message": message, "logprobs": lps,
            "finish_reason": finish_reason(final, calls), **schema_fields(final)}


def completion_choice(plan: Plan, index: int, final: gateway_pb2.Final, token_bytes) -> dict:
    return {"index": index, "text": final.text,
            "logprobs": completion_logprobs(plan, index, final.logprobs, token_bytes),
            "finish_reason": finish_reason(final, None), **schema_fields(final)}


def _token(token_id: int, token_bytes) -> tuple[str, list[int]]:
    raw = token_bytes(token_id)
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprobs(plan: Plan, index: int, lps, token_bytes) -> dict | None:
    """OpenAI's chat `logprobs` object for TokenLogprobs `lps` (None unless asked)."""
    if not plan.requests[index].sampling.logprobs:
        return None
    content = []
    for lp in lps:
        token, raw = _token(lp.token_id, token_bytes)
        top = []
        for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True):
            alt, alt_raw = _token(t, token_bytes)
            top.append({"token": alt, "logprob": v, "bytes": alt_raw})
        content.append({"token": token, "logprob": lp.logprob, "bytes": raw,
                        "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(plan: Plan, index: int, lps, token_bytes,
                        offset: int = 0) -> dict | None:
    """The legacy API's `logprobs` object (tokens, token_logprobs, top_logprobs, text_offset;
    None unless asked). `offset` is where these tokens' text starts in the choice's text."""
    if not plan.requests[index].sampling.logprobs:
        return None
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in lps:
        token, _ = _token(lp.token_id, token_bytes)
        out["tokens"].append(token)
        out["token_logprobs"].append(lp.logprob)
        out["top_logprobs"].append({_token(t, token_bytes)[0]: v for t, v in
                                    zip(lp.top_token_ids, lp.top_logprobs, strict=True)})
        out["text_offset"].append(offset)
        offset += len(token)
    return out
