"""What one server's routes share: its settings (from the command line), the engine loop and
metrics behind it, whether it drains, and the request fields it has warned about. A field the
server does not know is logged once per name (vLLM's server warns and ignores it the same
way): a client that sends `store=False` on every call gets one line, not one per request."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from pydantic import BaseModel

from runner.engine.api.interface import EngineInterface
from runner.serve.body_limit import MAX_BODY_BYTES
from runner.serve.calls import KEEPALIVE_S
from runner.serve.engine_loop import EngineLoop
from runner.serve.grammar_work import GrammarBounds, GrammarWork
from runner.serve.masking import Masker
from runner.serve.messages import unknown_fields
from runner.serve.metrics import ServeMetrics
from runner.serve.responses import LogprobFormat
from runner.serve.templates import RenderBounds
from runner.serve.tokenizing import TokenizerWork
from runner.serve.tool_calls import parser_for_template

log = logging.getLogger("runner.serve")


@dataclass
class ServeSettings:
    model_name: str
    api_key: str | None = None
    max_queued_requests: int = 1024  # samples (prompts x n) waiting to start
    retry_after_s: int = 1
    trust_request_chat_template: bool = False  # vLLM's flag: a client's own chat_template
    template_bounds: RenderBounds = RenderBounds()
    grammar_bounds: GrammarBounds = GrammarBounds()  # a structure's size and compile time
    stream_keepalive_s: float = KEEPALIVE_S  # a held stream's comment, this often at most
    body_timeout_s: float = 30.0  # from the request's head to the last byte of its body
    max_body_bytes: int = MAX_BODY_BYTES  # --max-body-bytes: past it a 413
    secret_urls: tuple[str, ...] = ()  # shown masked wherever they appear (tiers, handover)
    chat_template: str | None = None  # --chat-template: over the model's own
    tool_call_parser: str | None = None  # --tool-call-parser; None: read from the template
    # vLLM's further --served-model-name names: requests may name the model by any of them.
    model_aliases: tuple[str, ...] = ()

    def masker(self) -> Masker:
        keys = (self.api_key,) if self.api_key else ()
        return Masker(self.secret_urls, keys)


@dataclass
class ServerState:
    """What the routes share: the engine loop, its metrics, and whether the server drains."""

    llm: EngineInterface
    settings: ServeSettings
    engine: EngineLoop
    metrics: ServeMetrics
    fmt: LogprobFormat
    grammars: GrammarWork  # structures compiled off the engine's thread
    draining: bool = False
    warned: set[str] = field(default_factory=set)  # unknown request fields already logged
    tokenizing: TokenizerWork = field(default_factory=TokenizerWork)  # /tokenize's threads

    def warn_unknown(self, body: BaseModel) -> None:
        """Log each field of `body` the server ignores, the first time one is seen."""
        for name in unknown_fields(body):
            if name not in self.warned:
                self.warned.add(name)
                log.warning("the request field %r is not known here and is ignored", name)

    def tool_parser(self, template_kwargs: Mapping[str, object]) -> str:
        """The tool-call format answers are read in: --tool-call-parser, else the one the
        chat template (the request's, the server's or the model's) teaches."""
        if self.settings.tool_call_parser:
            return self.settings.tool_call_parser
        template = template_kwargs.get("chat_template") or self.settings.chat_template
        if template is None:
            template = getattr(self.llm.tokenizer, "chat_template", None)
        return parser_for_template(template if isinstance(template, str) else None)
