"""The OpenAPI schema the server publishes at /openapi.json: request and response bodies as
pydantic models mirroring OpenAI's fields and ranges (token ids bounded by the served model's
vocabulary), so external tools (schemathesis, client generators) know the API.

These models document; they do not validate. Requests are checked field by field by
protocol.py, whose messages name the field and say what to do; the models say the same thing in
JSON Schema (extra fields forbidden, the same ranges), and tests/test_serve_fuzz.py checks that
the two agree. Rules across fields (prompt + max_tokens within the context, top_logprobs with
logprobs, n > 1 only when sampling, stream_options only with stream) are beyond JSON Schema and
answered with a 400, which every route documents.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from .fields import INT64, MAX_LOGPROBS, MAX_N

Temperature = Annotated[float, Field(ge=0, le=2)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
Int64 = Annotated[int, Field(ge=-INT64, le=INT64 - 1)]
Bias = Annotated[float, Field(ge=-100, le=100)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: Optional[bool] = None
    continuous_usage_stats: Optional[bool] = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class CalledFunction(_Strict):
    name: str
    arguments: str = Field(description="the arguments as a JSON string")


class ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: CalledFunction


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[TextPart]]] = Field(
        None, description="required, but for an assistant message with tool_calls")
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = Field(None, description="an assistant's earlier calls")
    tool_call_id: Optional[str] = Field(None, description="role tool: the call this result answers (required)")
    function_call: None = None


class ResponseFormatText(_Strict):
    type: Literal["text"]


class ResponseFormatJsonObject(_Strict):
    type: Literal["json_object"]


class JsonSchemaSpec(_Strict):
    name: Annotated[str, Field(min_length=1)]
    schema_: dict[str, Any] = Field(alias="schema", description="a JSON schema llguidance can compile")
    strict: Optional[bool] = None
    description: Optional[str] = None


class ResponseFormatJsonSchema(_Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Union[ResponseFormatText, ResponseFormatJsonObject, ResponseFormatJsonSchema]


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(min_length=1)] = Field(description="unique among the tools")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = Field(None, description="a JSON schema of the arguments")
    strict: Optional[bool] = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


def request_models(vocab: int) -> tuple[type[BaseModel], type[BaseModel]]:
    """(CompletionRequest, ChatCompletionRequest) for a model of `vocab` tokens."""
    TokenId = Annotated[int, Field(ge=0, le=vocab - 1)]
    TokenIds = Annotated[list[TokenId], Field(min_length=1)]
    BiasMap = Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]+$")], Bias], Field()]

    class Sampling(_Strict):
        model: Optional[str] = None
        temperature: Optional[Temperature] = Field(None, description="0 is greedy; default 1")
        top_p: Optional[Annotated[float, Field(gt=0, le=1)]] = None
        top_k: Optional[Annotated[int, Field(ge=-1)]] = Field(None, description="vLLM's; -1 or 0: off")
        min_p: Optional[Annotated[float, Field(ge=0, le=1)]] = None
        presence_penalty: Optional[Penalty] = None
        frequency_penalty: Optional[Penalty] = None
        repetition_penalty: Optional[Annotated[float, Field(gt=0)]] = None
        logit_bias: Optional[BiasMap] = Field(None, description="token id (as a string) -> bias")
        seed: Optional[Int64] = None
        n: Optional[Annotated[int, Field(ge=1, le=MAX_N)]] = Field(None, description="> 1 needs temperature > 0")
        stop: Optional[Union[str, list[str]]] = Field(None, description="empty strings are ignored")
        stop_token_ids: Optional[list[TokenId]] = None
        stream: Optional[bool] = None
        stream_options: Optional[StreamOptions] = Field(None, description="only with stream: true")
        user: Optional[str] = None
        ignore_eos: Optional[bool] = None
        speculate: Optional[bool] = Field(None, description="Outrider: false decodes without drafts")
        max_draft_tokens: Optional[Annotated[int, Field(ge=0)]] = Field(None, description="Outrider")
        grammar_drafting: Optional[bool] = Field(None, description="Outrider: false: the grammar only masks "
                                                 "the target's distribution")
        response_format: Optional[ResponseFormat] = None
        min_tokens: Optional[Literal[0]] = None
        include_stop_str_in_output: Optional[Literal[False]] = None
        skip_special_tokens: Optional[Literal[True]] = None
        spaces_between_special_tokens: Optional[Literal[True]] = None
        use_beam_search: Optional[Literal[False]] = None
        length_penalty: Optional[Literal[1]] = None
        prompt_logprobs: None = None
        priority: Optional[Literal[0]] = None

    class CompletionRequest(Sampling):
        prompt: Union[Annotated[str, Field(min_length=1)],
                      Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_N)],
                      TokenIds, Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_N)]]
        max_tokens: Optional[Annotated[int, Field(ge=0)]] = Field(
            None, description="default 16; 0 only with echo; prompt + max_tokens must fit the context")
        logprobs: Optional[Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]] = None
        echo: Optional[bool] = None
        best_of: Optional[Annotated[int, Field(ge=1, le=MAX_N)]] = Field(None, description="null or equal to n")
        suffix: None = Field(None, description="not supported (as in vLLM)")
        add_special_tokens: Optional[Literal[True]] = None

    class ChatCompletionRequest(Sampling):
        messages: Annotated[list[Message], Field(min_length=1)]
        max_tokens: Optional[Annotated[int, Field(ge=1)]] = None
        max_completion_tokens: Optional[Annotated[int, Field(ge=1)]] = None
        logprobs: Optional[bool] = None
        top_logprobs: Optional[Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]] = Field(
            None, description="needs logprobs: true")
        echo: Optional[Literal[False]] = None
        metadata: Optional[dict[str, str]] = None
        service_tier: Optional[str] = None
        store: Optional[Literal[False]] = None
        prompt_cache_key: Optional[str] = None
        safety_identifier: Optional[str] = None
        tools: Optional[Annotated[list[Tool], Field(min_length=1)]] = Field(
            None, description="with tools, tool_choice must be \"required\" or a named function (\"auto\", the "
                              "default, is refused as vLLM refuses it without a tool-call parser)")
        tool_choice: Optional[Union[Literal["none", "required"], NamedToolChoice]] = None
        parallel_tool_calls: Optional[bool] = None
        functions: None = None
        function_call: None = None
        modalities: Optional[list[Literal["text"]]] = None
        audio: None = None
        prediction: None = None
        reasoning_effort: None = None
        verbosity: None = None
        web_search_options: None = None
        add_special_tokens: Optional[Literal[False]] = None
        add_generation_prompt: Optional[Literal[True]] = None
        continue_final_message: Optional[Literal[False]] = None

    return CompletionRequest, ChatCompletionRequest


# -- responses ------------------------------------------------------------------------------------
class ErrorInfo(_Strict):
    message: str
    type: str
    param: Optional[str]
    code: Optional[str]


class ErrorResponse(_Strict):
    error: ErrorInfo


class PromptTokensDetails(_Strict):
    cached_tokens: int = Field(description="prompt tokens whose K/V came from the prefix cache")


class Usage(_Strict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = None


Finish = Optional[Literal["stop", "length", "abort", "tool_calls"]]


class CompletionLogprobs(_Strict):
    tokens: list[str]
    token_logprobs: list[Optional[float]]
    top_logprobs: list[Optional[dict[str, float]]]
    text_offset: list[int]


class CompletionChoice(_Strict):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs]
    finish_reason: Finish


class CompletionResponse(_Strict):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    outrider: dict[str, Any] = Field(description="this request's speculation figures (tau, rounds, drafts)")


class TopLogprob(_Strict):
    token: str
    logprob: float
    bytes: Optional[list[int]]


class TokenLogprobs(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Strict):
    content: Optional[list[TokenLogprobs]]


class AssistantMessage(_Strict):
    role: Literal["assistant"]
    content: Optional[str] = Field(description="null when the reply is a tool call")
    tool_calls: Optional[list[ToolCall]] = Field(None, description="one call (finish_reason tool_calls)")


class ChatChoice(_Strict):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChatLogprobs]
    finish_reason: Finish


class ChatCompletionResponse(_Strict):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    outrider: dict[str, Any]


class CompletionChunkChoice(_Strict):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs]
    finish_reason: Finish


class CompletionChunk(_Strict):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice] = Field(description="one choice's new text; [] in the last usage chunk")
    usage: Optional[Usage] = None
    outrider: Optional[dict[str, Any]] = Field(None, description="with a choice's finish_reason")


class ToolCallDelta(ToolCall):
    index: int


class Delta(_Strict):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCallDelta]] = Field(None, description="a tool call, whole, when it is complete")


class ChatChunkChoice(_Strict):
    index: int
    delta: Delta
    logprobs: Optional[ChatLogprobs]
    finish_reason: Finish


class ChatCompletionChunk(_Strict):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None
    outrider: Optional[dict[str, Any]] = None


CHUNKS = (CompletionChunk, ChatCompletionChunk)


class ModelCard(_Strict):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(_Strict):
    object: Literal["list"]
    data: list[ModelCard]


class PrefixCacheHealth(_Strict):
    enabled: bool
    reason: Optional[str] = None  # why it is off (or a limit it works under)
    block_tokens: Optional[int] = None
    budget_mb: Optional[float] = None
    blocks: Optional[int] = None  # blocks held now
    usage: Optional[float] = None  # blocks held over the pool's capacity
    queries: Optional[int] = None  # prompt tokens looked up
    hits: Optional[int] = None  # of those, tokens restored


class KvPagesHealth(_Strict):
    pages: int  # the pool's pages (--kv-memory)
    page_rows: int
    used: int  # held by running requests now
    memory_mb: float
    preemptions: int  # requests preempted for pages so far (engine/paging.py)


class Health(_Strict):
    status: Literal["ok", "draining", "failed"]
    error: Optional[str] = None
    replicas: Optional[int] = None  # `--replicas N` (outrider/cluster): how many were started
    replicas_alive: Optional[int] = None
    replica_restarts: Optional[int] = None  # new actors started in dead replicas' slots so far
    prefix_cache: Optional[PrefixCacheHealth] = None  # engine/prefix_cache.py: its blocks and counters, or why off
    kv_pages: Optional[KvPagesHealth] = None  # paged K/V's pool (--kv-memory); absent with slots


def stream(chunk_model: str) -> dict:
    """A server-sent event of a stream: an OpenAI chunk (or an error body) as JSON, or the last [DONE]."""
    payload = {"type": "string", "contentMediaType": "application/json",
               "contentSchema": {"anyOf": [{"$ref": f"#/components/schemas/{chunk_model}"},
                                           {"$ref": "#/components/schemas/ErrorResponse"}]}}
    return {"text/event-stream": {"schema": {
        "type": "object", "required": ["data"], "description": "one server-sent event; the stream ends with [DONE]",
        "properties": {"data": {"anyOf": [{"const": "[DONE]"}, payload]}, "event": {"type": "string"}}}}}


def errors(*statuses: int) -> dict:
    why = {400: "a bad body: the message names the field", 401: "a missing or wrong API key",
           404: "another model's name, or no such route", 405: "a method the route does not take",
           413: "the body is over the server's limit (--max-body-mb)",
           429: "the queue is full (Retry-After)", 500: "the request failed in the engine",
           503: "the server is shutting down or restarting"}
    return {s: {"model": ErrorResponse, "description": why[s]} for s in statuses}


def request_body(name: str) -> dict:
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}}}


def add_request_schemas(openapi: dict, vocab: int, api_key: bool) -> dict:
    """Put the request models (and, with a key, bearer auth) into a FastAPI-generated schema."""
    components = openapi.setdefault("components", {}).setdefault("schemas", {})
    for model in (*request_models(vocab), *CHUNKS):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        components[model.__name__] = schema
    if api_key:
        openapi["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in openapi["paths"].items():
            if path not in ("/health", "/openapi.json"):
                for operation in item.values():
                    operation["security"] = [{"bearer": []}]
    return openapi
