"""The text bridge: tokenizer, chat-template pieces, the env's messages as token tables, reply parsing.

    tables = text.tables_for_env(tokenizer, env)            # host, once: verified against the chat template
    tokens, n = text.render_turn(tables, codes, first, final)   # device: one user turn from slot codes
    reply = text.parse_reply(tables, grammar, tokens, length)   # device: ParsedReply with Python-re semantics
"""

from jaxrl_llm.text.chat import chat_pieces, token_bytes  # noqa: F401
from jaxrl_llm.text.grammar import (  # noqa: F401
    ReplyTemplate, content_span, content_token_mask, parse_bytes, parse_reply, reply_bytes,
)
from jaxrl_llm.text.tables import (  # noqa: F401
    TextTables, build_text_tables, gather_pieces, render_turn, require_reply_template, tables_for_env,
)
from jaxrl_llm.text.tokenizer import CHAT_TEMPLATE, check_tokenizer, load_tokenizer  # noqa: F401

