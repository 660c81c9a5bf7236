"""Tokenize a prompt or chat messages exactly as the completion endpoints will; detokenize."""

from __future__ import annotations

from worker.entrypoints.chat_completions.protocol import ChatTemplateFields
from worker.entrypoints.chat_completions.serving import refuse_tools, render_chat
from worker.entrypoints.serving import WorkerState
from worker.entrypoints.tokenize.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)


class TokenizeServing:
    def __init__(self, state: WorkerState) -> None:
        self.state = state

    def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        self.state.check_model(body.model)
        refuse_tools(body)
        tokenizer = self.state.runner.tokenizer
        if body.messages is not None:
            ids = render_chat(
                tokenizer,
                ChatTemplateFields(
                    messages=body.messages,
                    add_generation_prompt=body.add_generation_prompt,
                    continue_final_message=body.continue_final_message,
                ),
            )
        else:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = list(tokenizer.encode(body.prompt or "", add_special_tokens=special))
        strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return TokenizeResponse(
            count=len(ids),
            max_model_len=self.state.runner.max_model_len,
            tokens=ids,
            token_strs=strs,
        )

    def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self.state.check_model(body.model)
        self.state.check_ids(body.tokens, param="tokens")
        return DetokenizeResponse(prompt=self.state.runner.tokenizer.decode(body.tokens))
