"""POST /tokenize and /detokenize, as vLLM's server has them: a prompt (or chat messages through
the model's chat template) to the token ids the model would be given, and token ids back to
text, with the model's own tokenizer. Nothing reaches Triton."""
from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse, Response

from tritium.frontend.chat import template_messages
from tritium.frontend.errors import OpenAIError, bad_request
from tritium.frontend.limits import check_prompt_text
from tritium.frontend.model_registry import ModelRegistry, Target
from tritium.frontend.protocol import ChatMessage, Tool, _Body, parse_body
from tritium.frontend.refused_fields import refuse_unsupported

# The most token ids one /detokenize takes: more than any model's context, and bounded so that
# one request cannot hold this process decoding for long.
MAX_DETOKENIZE_TOKENS = 2**20


class TokenizeCompletionRequest(_Body):
    model: str | None = None  # vLLM's: optional, the served model
    prompt: str
    add_special_tokens: bool = True  # the tokenizer's BOS, as the engine adds it to a text prompt
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Body):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template holds the BOS, as in chat completions
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


class Tokenization:
    """Serves /tokenize and /detokenize from the registry's tokenizers."""

    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry

    async def tokenize(self, body: Any) -> Response:
        chat = isinstance(body, dict) and "messages" in body  # vLLM's two request shapes
        if chat:  # a template of the request's own: vLLM too refuses it unless trusted
            refuse_unsupported(body, {"chat_template": (None,)})
        req = parse_body(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)
        model = (await self._target(req.model)).model
        if isinstance(req, TokenizeChatRequest):
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            text = model.apply_chat_template(template_messages(req), tools, req.add_generation_prompt,
                                             req.continue_final_message, req.chat_template_kwargs or {})
            check_prompt_text(text)
        else:
            text = req.prompt
        ids = model.encode(text, add_special_tokens=req.add_special_tokens)
        token_strs = model.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids,
                             "token_strs": token_strs})

    async def detokenize(self, body: Any) -> Response:
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if isinstance(tokens, list) and len(tokens) > MAX_DETOKENIZE_TOKENS:  # before validation
            raise bad_request(f"tokens may hold at most {MAX_DETOKENIZE_TOKENS} token ids, got {len(tokens)}.",
                              "tokens")
        req = parse_body(DetokenizeRequest, body)
        model = (await self._target(req.model)).model
        vocab = len(model.tokenizer)
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:  # the tokenizer would decode it as nothing, or fail
            raise bad_request(f"tokens: token id {bad} is out of vocabulary (valid ids are 0 to {vocab - 1}).",
                              "tokens")
        # As vLLM: the special tokens are kept, so that the text is what the ids say.
        return JSONResponse({"prompt": model.decode(req.tokens)})

    async def _target(self, name: str | None) -> Target:
        """The model named, or without a name (vLLM's requests may leave it out) the one model
        this frontend serves."""
        if name is not None:
            return await self.registry.resolve(name)
        ready = await self.registry.ready_models()
        if not ready:
            raise OpenAIError(503, "no model is ready")
        if len(ready) > 1:
            raise bad_request(f"model is required: this server serves {len(ready)} models", "model")
        return await self.registry.resolve(self.registry.public_names(ready[0])[0])
