"""`qkv chat DIR`: talk to a model folder through its chat template, in a terminal or from a script.

    session = ChatSession.from_folder("path/to/model", system="Answer briefly.")
    answer = session.reply("What is a KV cache?", on_text=print_piece)   # streamed through on_text
    session.reset()                                                      # forget the conversation

Each turn renders the whole conversation with the folder's chat template (add_generation_prompt=True),
generates with qkv.generate.stream and stops at the template's end-of-turn tokens: the tokenizer's eos ids,
the model's generation_config.json eos ids, and the special token the template writes right after an
assistant message (ChatML's <|im_end|>, Llama 3's <|eot_id|>). The oldest turns are dropped (the system
prompt is kept) when the conversation and the answer would not fit in the model's context.

A folder without a chat template gets a plain transcript ("User: ...\\nAssistant:") and a note saying so;
the answer then stops at the next "User:" line or an eos token.

Ctrl-C while an answer streams stops that answer (what was said so far stays in the history); at the
prompt it only reminds how to leave. /reset forgets the conversation, /exit (or end of input) leaves.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from qkv.config import ConfigError
from qkv.generate import GenerationConfig, stream
from qkv.generate.text import stream_pieces
from qkv.models.decoding import configured_context
from qkv.run import hf_folder_tokenizer, load_model_any, model_folder

PLAIN_USER, PLAIN_ASSISTANT = "User:", "Assistant:"
DEFAULT_ANSWER_TOKENS = 512  # an answer's length when none is asked for, capped by the model's context
NO_TEMPLATE_NOTE = (
    "qkv: note: {folder} has no chat template (no chat_template.jinja, no `chat_template` in "
    "tokenizer_config.json): using a plain 'User: ... / Assistant:' transcript; a base model may "
    "not follow it"
)


def plain_transcript(
    messages: list[dict[str, str]], eos: str, *, reply: bool
) -> tuple[str, list[tuple[int, int]]]:
    """The conversation as qkv writes it for a folder without a chat template, in chat and in fine-tuning
    alike: "system\n\nUser: ...\nAssistant: ...<eos>\nUser: ...", every answer followed by the eos (which
    fine-tuning teaches the model to write), ending with "Assistant:" when a reply is wanted. Returns the text
    and the character spans of each " answer<eos>"."""
    text, spans = "", []
    for m in messages:
        if m["role"] == "system":
            text += m["content"] + "\n\n"
        elif m["role"] == "user":
            text += f"{PLAIN_USER} {m['content']}\n"
        else:
            text += PLAIN_ASSISTANT
            start = len(text)
            text += f" {m['content']}{eos}"
            spans.append((start, len(text)))
            text += "\n"
    return (text + PLAIN_ASSISTANT if reply else text.rstrip("\n")), spans


def end_of_turn_ids(tok: Any) -> set[int]:
    """The ids that end an assistant turn (HFTokenizer.end_of_turn_ids: the eos ids and the special token the
    template writes right after an assistant message's content; the same ids the fine-tuning loss covers)."""
    return set(tok.end_of_turn_ids)


@dataclass
class ChatSession:
    """A conversation with one model: the history, how to turn it into token ids, and the decoding."""

    model: Any
    tokenizer: Any
    system: str | None = None
    generation_config: GenerationConfig = field(default_factory=GenerationConfig)
    history: list[dict[str, str]] = field(default_factory=list)
    note: Callable[[str], None] = field(default=lambda msg: print(msg, file=sys.stderr))
    assistant_model: Any = None  # a draft model of the same tokenizer: speculative decoding

    def __post_init__(self) -> None:
        self.templated = bool(self.tokenizer.has_chat_template)
        self.stop_ids = end_of_turn_ids(self.tokenizer)
        defaults = self.model.generation_defaults() if hasattr(self.model, "generation_defaults") else {}
        model_eos = defaults.get("eos_token_id")
        if model_eos is not None:
            self.stop_ids |= set(model_eos if isinstance(model_eos, list) else [model_eos])
        self.context = configured_context(self.model)  # the limit generate() and qkv serve hold to

    @classmethod
    def from_folder(cls, folder: str | Path, quantize: str | None = None, **kwargs: Any) -> ChatSession:
        """A session over a Hugging Face folder; quantize: "int8" / "int4" weight-only (qkv.nn.quant)."""
        mf = model_folder(folder)
        tok = hf_folder_tokenizer(mf)
        if tok is None:
            raise ConfigError(f"{folder}: qkv chat needs a Hugging Face model folder with a tokenizer.json "
                              "(config.json with a model_type)")
        model = load_model_any(folder, quantize).eval()
        session = cls(model, tok, **kwargs)
        if not session.templated:
            session.note(NO_TEMPLATE_NOTE.format(folder=folder))
        return session

    def reset(self) -> None:
        self.history.clear()

    # -- the prompt --------------------------------------------------------------------------------------
    def _messages(self, turns: list[dict[str, str]]) -> list[dict[str, str]]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + turns

    def _render(self, turns: list[dict[str, str]]) -> list[int]:
        if self.templated:
            return self.tokenizer.apply_chat_template(self._messages(turns), add_generation_prompt=True,
                                                      tokenize=True)
        eos = getattr(self.tokenizer, "eos_token", None) or ""
        text, _ = plain_transcript(self._messages(turns), eos, reply=True)
        return self.tokenizer.encode(text, add_special_tokens=True)

    def prompt_ids(self, max_new_tokens: int) -> list[int]:
        """The conversation as ids, dropping the oldest exchanges until it and the answer fit the context."""
        turns = list(self.history)
        while True:
            ids = self._render(turns)
            if self.context is None or len(ids) + max_new_tokens <= self.context:
                if len(turns) < len(self.history):
                    self.note(
                        f"qkv: note: dropped the {len(self.history) - len(turns)} oldest message(s) to fit "
                        f"the context of {self.context} tokens"
                    )
                    del self.history[: len(self.history) - len(turns)]
                return ids
            if len(turns) <= 1:
                raise ValueError(
                    f"the message ({len(ids)} tokens with the template) + max_new_tokens={max_new_tokens}"
                    f" does not fit the model's context of {self.context} tokens; shorten it or lower "
                    "--max-new-tokens"
                )
            turns = turns[2:] if turns[0]["role"] == "user" and len(turns) > 2 else turns[1:]

    def _default_budget(self) -> tuple[list[int], int]:
        """The prompt ids and the answer's length when none was asked for: DEFAULT_ANSWER_TOKENS, capped by
        the context. Older exchanges are dropped to keep room for min(DEFAULT_ANSWER_TOKENS, context / 2)
        answer tokens; a single message longer than that answers in whatever room it leaves (at least one
        token), instead of refusing a request the user never sized (a 512-token default on a 128-position
        model)."""
        if self.context is None:
            return self.prompt_ids(DEFAULT_ANSWER_TOKENS), DEFAULT_ANSWER_TOKENS
        room = min(DEFAULT_ANSWER_TOKENS, max(1, self.context // 2))
        try:
            ids = self.prompt_ids(room)
        except ValueError:
            ids = self.prompt_ids(1)  # still a clear error when not even one answer token fits
        return ids, min(DEFAULT_ANSWER_TOKENS, self.context - len(ids))

    # -- one turn ------------------------------------------------------------------------------------------
    def reply(self, message: str, on_text: Callable[[str], None] | None = None) -> str:
        """Add the user's message, generate the answer (each new piece of text goes to on_text as it comes),
        add it to the history and return it. Ctrl-C (KeyboardInterrupt) stops the answer where it is."""
        self.history.append({"role": "user", "content": message})
        cfg = self.generation_config
        try:
            if cfg.max_new_tokens is None and cfg.max_length is None:
                ids, new = self._default_budget()
                cfg = cfg.replace(max_new_tokens=new)
            else:
                ids = self.prompt_ids(cfg.max_new_tokens or 0)
        except ValueError:
            self.history.pop()
            raise
        stop_ids = sorted(self.stop_ids)
        cfg = cfg.replace(eos_token_id=stop_ids or None)
        options: dict[str, Any] = {}
        if self.assistant_model is not None:
            options["assistant_model"] = self.assistant_model
        if not self.templated:
            cfg = cfg.replace(stop_strings=["\n" + PLAIN_USER])
            options["tokenizer"] = self.tokenizer
        answer, interrupted = self._stream_answer(ids, cfg, options, on_text)
        if interrupted:
            self.note("\nqkv: answer stopped (Ctrl-C)")
        self.history.append({"role": "assistant", "content": answer})
        return answer

    def _stream_answer(self, ids: list[int], cfg: GenerationConfig, options: dict[str, Any],
                       on_text: Callable[[str], None] | None) -> tuple[str, bool]:
        """(the answer, whether Ctrl-C stopped it): the tokens through the one streaming loop
        (generate.text.stream_pieces) and the tokenizer's StreamDecoder, each visible piece to on_text."""
        tokens = stream(self.model, torch.tensor([ids]), cfg, **options)
        interrupted, ended = False, False
        text, shown = "", 0  # shown: characters passed to on_text (a plain transcript holds back "\nUser:")

        def token_ids() -> Iterator[int]:
            nonlocal interrupted, ended
            try:
                for new in tokens:
                    yield int(new[0])
            except KeyboardInterrupt:
                interrupted = True
            finally:
                tokens.close()  # restores the model's mode; stops at once on Ctrl-C
                ended = True

        def write(piece: str) -> None:
            nonlocal text, shown
            if ended:  # the decoder's rest and stream_pieces' line end: shown once cleaned, below
                return
            text += piece
            shown = self._show(text, shown, on_text, final=False)

        decoder, ids_in = self.tokenizer.stream_decoder(skip_special_tokens=True), token_ids()
        try:
            full = stream_pieces(ids_in, decoder, write)
        except KeyboardInterrupt:  # Ctrl-C while on_text shows a piece
            interrupted = True
            ids_in.close()
            full = text + decoder.flush()
        answer = self._clean(full)
        self._show(answer, shown, on_text, final=True)
        return answer, interrupted

    def _clean(self, text: str) -> str:
        if not self.templated:
            cut = text.find("\n" + PLAIN_USER)
            if cut >= 0:
                text = text[:cut]
        return text.strip()

    def _show(self, text: str, shown: int, on_text: Callable[[str], None] | None, final: bool) -> int:
        """Pass on_text what became visible since `shown` characters: the answer without leading space, and in
        the plain transcript without a "\nUser:" (or the start of one, held back until it is decided)."""
        if on_text is None:
            return shown
        visible = self._clean(text) if final else text.lstrip()
        if not final and not self.templated:
            tail = "\n" + PLAIN_USER
            cut = visible.find(tail)
            if cut >= 0:
                visible = visible[:cut]
            else:
                for k in range(len(tail), 0, -1):
                    if visible.endswith(tail[:k]):
                        visible = visible[:-k]
                        break
        if len(visible) > shown:
            on_text(visible[shown:])
            return len(visible)
        return shown


HELP = "commands: /reset forgets the conversation, /exit leaves (or Ctrl-D); Ctrl-C stops an answer"


def chat_loop(session: ChatSession, lines: Iterable[str] | None = None, out: TextIO | None = None,
              prompt: str = ">>> ") -> int:
    """The interactive chat: read a message per line (from `lines`, default stdin), stream the answer to
    `out` (default stdout). Returns the number of answers given."""
    out = out or sys.stdout
    source = iter(lines) if lines is not None else None
    if source is None:
        # input() then edits the line and recalls earlier messages (arrow keys), where Python has readline
        try:
            import readline  # noqa: F401, PLC0415  (absent on some platforms)
        except ImportError:
            pass
    answers = 0

    def read() -> str | None:
        out.write(prompt)
        out.flush()
        if source is not None:
            line = next(source, None)
            if line is not None:
                out.write(line.rstrip("\n") + "\n")
            return line
        try:
            return input()
        except EOFError:
            return None

    print(
        HELP + ("; /image PATH sets the image of your next message" if hasattr(session, "set_image") else ""),
        file=out,
    )
    while True:
        try:
            line = read()
        except KeyboardInterrupt:
            print("\n(/exit or Ctrl-D to leave)", file=out)
            continue
        if line is None:
            out.write("\n")
            return answers
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return answers
        if text == "/reset":
            session.reset()
            print("(conversation cleared)", file=out)
            continue
        if text.startswith("/image") and hasattr(session, "set_image"):  # a vision-language session
            try:
                session.set_image(text[len("/image"):].strip())
                print("(image set: it goes with your next message; the conversation starts again)", file=out)
            except ValueError as e:
                print(f"qkv: error: {e}", file=out)
            continue
        if text.startswith("/"):
            print(f"(unknown command {text.split()[0]}; {HELP})", file=out)
            continue
        try:
            session.reply(text, on_text=lambda piece: (out.write(piece), out.flush()))
        except ValueError as e:
            print(f"qkv: error: {e}", file=out)
            continue
        out.write("\n")
        answers += 1


__all__ = ["ChatSession", "chat_loop", "end_of_turn_ids"]
