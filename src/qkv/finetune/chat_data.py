"""The chat recipe's data: JSONL conversations read and checked, rendered with the model folder's chat
template (or qkv chat's plain transcript) into token ids and labels on the assistant's tokens only, and the
batch source the Trainer reads (see qkv.finetune.chat for the format and why rows are not packed)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qkv.config import ConfigError
from qkv.finetune.chat_images import attach_images, encode_image_chat, has_images, read_parts, resolve_images
from qkv.finetune.chat_tokens import IGNORE, encode_plain
from qkv.finetune.data import read_data_text

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class RecordLimits:
    """What one JSONL record may hold, checked before it is parsed (its length) or its turns are read:
    a record past either could never fit a context anyway, and would only cost the time and memory of
    reading it (10^6 turns: 12 s and 1.2 GB here before the first check)."""

    max_chars: int = 64 * 2**20  # one line: room for a few inline base64 images
    max_turns: int = 4096  # messages of one conversation (each renders to at least one token)


# -- reading the data --------------------------------------------------------------------------------------
# ShareGPT's speakers (the "conversations" form LLaMA-Factory and FastChat read) -> the roles of "messages"
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system"}


def _content(content: Any, where: str) -> Any:
    """A message's content: a string, or a list of text and image parts (qkv.finetune.chat_images)."""
    if isinstance(content, list):
        return read_parts(content, where)
    if not isinstance(content, str):
        raise ConfigError(f"{where}: 'content' must be a string (or a list of text and image_url parts)")
    return content


def _objects(value: Any, where: str, name: str, item: str, keys: tuple[str, str],
             limits: RecordLimits) -> list[dict[str, Any]]:
    """`value` checked as the non-empty list of objects with `keys` that record field `name` holds."""
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: '{name}' must be a non-empty list of {{{', '.join(keys)}}} objects")
    if len(value) > limits.max_turns:
        raise ConfigError(f"{where}: '{name}' holds {len(value):,} turns, over the limit of "
                          f"{limits.max_turns:,} (RecordLimits.max_turns)")
    for i, x in enumerate(value):
        if not isinstance(x, dict) or any(k not in x for k in keys):
            raise ConfigError(f"{where}: {item} {i} must be an object with '{keys[0]}' and '{keys[1]}'")
    return value


def _from_messages(msgs: Any, where: str, limits: RecordLimits) -> list[dict[str, Any]]:
    """The "messages" form: OpenAI's [{role, content}, ...]."""
    out = []
    for i, m in enumerate(_objects(msgs, where, "messages", "message", ("role", "content"), limits)):
        if not isinstance(m["role"], str) or m["role"] not in ROLES:
            raise ConfigError(f"{where}: message {i} has unknown role {m['role']!r} "
                              f"(expected one of {', '.join(ROLES)})")
        out.append({"role": m["role"], "content": _content(m["content"], f"{where}: message {i}")})
    return out


def _from_sharegpt(turns: Any, where: str, limits: RecordLimits) -> list[dict[str, Any]]:
    """ShareGPT's "conversations" form: [{from: human | gpt | system, value}, ...] (also user / assistant)."""
    out = []
    for i, t in enumerate(_objects(turns, where, "conversations", "conversation turn", ("from", "value"),
                                   limits)):
        if not isinstance(t["from"], str) or t["from"] not in SHAREGPT_ROLES:
            raise ConfigError(f"{where}: conversation turn {i} is from {t['from']!r} (expected one of "
                              f"{', '.join(SHAREGPT_ROLES)}; tool turns are not read)")
        if not isinstance(t["value"], str):
            raise ConfigError(f"{where}: conversation turn {i}: 'value' must be a string")
        out.append({"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]})
    return out


def _from_prompt(obj: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """The prompt/completion form: one user turn and its answer."""
    if not isinstance(obj.get("prompt"), str) or not isinstance(obj.get("completion"), str):
        raise ConfigError(f"{where}: a prompt/completion record needs both as strings")
    return [{"role": "user", "content": obj["prompt"]}, {"role": "assistant", "content": obj["completion"]}]


def _with_system(obj: dict[str, Any], out: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """A top-level "system" string (prompt/completion and ShareGPT records) as the first message."""
    if obj.get("system") is None:
        return out
    if not isinstance(obj["system"], str):
        raise ConfigError(f"{where}: 'system' must be a string")
    if out[0]["role"] == "system":
        raise ConfigError(f"{where}: a top-level 'system' and a system turn: give one of them")
    return [{"role": "system", "content": obj["system"]}, *out]


def _messages(obj: Any, where: str, limits: RecordLimits) -> list[dict[str, Any]]:
    """The conversation of one JSONL record in any of its forms, checked; errors name `where` (file:line)."""
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: expected a JSON object with 'messages' (or 'conversations', or "
                          f"'prompt'/'completion'), got a JSON {type(obj).__name__}")
    if "messages" in obj:
        out = _from_messages(obj["messages"], where, limits)
    elif "conversations" in obj:
        out = _with_system(obj, _from_sharegpt(obj["conversations"], where, limits), where)
    elif "prompt" in obj or "completion" in obj:
        out = _with_system(obj, _from_prompt(obj, where), where)
    else:
        raise ConfigError(f"{where}: missing 'messages' (or 'conversations', or 'prompt' and 'completion'); "
                          f"the record has {', '.join(map(repr, obj)) or 'no keys'}")
    if "images" in obj:  # <image> markers in the text, the files listed (qkv.finetune.chat_images)
        attach_images(obj["images"], out, where)
    if not any(m["role"] == "assistant" and (m["content"] if isinstance(m["content"], str) else any(
            p["type"] == "text" and p["text"] for p in m["content"])) for m in out):
        raise ConfigError(f"{where}: no assistant message with content: nothing to learn from this record")
    return out


def read_chats(path: str | Path,
               limits: RecordLimits = RecordLimits()) -> list[tuple[int, list[dict[str, str]]]]:
    """[(line number, messages)] of a JSONL file. Blank lines are skipped; anything else that is not a valid
    record, or one over `limits`, is one ConfigError naming the file and line."""
    path = Path(path)
    text = read_data_text(path, "{path}:{line}")  # a byte order mark dropped; not UTF-8: file:line
    if not text.strip():
        raise ConfigError(f"{path}: the file is empty (expected one JSON object per line)")
    out = []
    # at "\n" only, as wc -l counts (see tasks.base.text_lines)
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        obj = parse_record(line, f"{path}:{n}", limits)
        messages = _messages(obj, f"{path}:{n}", limits)
        resolve_images(messages, path.parent, f"{path}:{n}")  # image paths are relative to the file
        out.append((n, messages))
    return out


def parse_record(line: str, where: str, limits: RecordLimits) -> Any:
    """One JSONL line's value; a ConfigError naming `where` for a line over limits.max_chars (checked before
    it is parsed) or one that is not JSON (nested past the parser's depth, an integer of over 4,300 digits:
    ValueError or RecursionError from json)."""
    if len(line) > limits.max_chars:
        raise ConfigError(f"{where}: the record is {len(line):,} characters long, over the limit of "
                          f"{limits.max_chars:,} (RecordLimits.max_chars)")
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise ConfigError(f"{where}: invalid JSON (nested too deeply)") from None
    except ValueError as e:
        raise ConfigError(f"{where}: invalid JSON ({str(e)[:120]})") from None


# -- rendering and labels ---------------------------------------------------------------------------------
@dataclass
class Example:
    line: int
    input_ids: list[int]
    labels: list[int]  # IGNORE outside the assistant's tokens
    pixel_values: Tensor | None = None  # (n, C, H, W): the record's images, in the order of its placeholders


def encode_chat(tok: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """(ids, labels) of one conversation: rendered with the folder's chat template, labels = ids on the
    assistant's tokens (the template's assistant mask) and IGNORE elsewhere. Without a template: the plain
    concatenation (see the module docstring)."""
    if tok.has_chat_template:
        ids, mask = tok.apply_chat_template(messages, return_assistant_mask=True)
        return list(ids), [i if m else IGNORE for i, m in zip(ids, mask)]
    return encode_plain(tok, messages)


def build_examples(tok: Any, records: list[tuple[int, list[dict[str, Any]]]], max_length: int, path: str,
                   too_long: str, vision: Any = None) -> tuple[list[Example], list[int]]:
    """Examples of the records; records over max_length tokens are an error (too_long="error") or skipped
    and listed (too_long="skip"). Returns (examples, skipped line numbers). vision: a vision-language
    model's image preprocessing (qkv.finetune.chat_images.VisionData), which renders every record."""
    out, skipped = [], []
    for line, msgs in records:
        pixels = None
        if vision is None and has_images(msgs):
            raise ConfigError(f"{path}:{line}: the record has images, but the model is not a "
                              "vision-language model (a llava, idefics3 or smolvlm folder)")
        try:
            if vision is not None:
                ids, labels, pixels = encode_image_chat(tok, msgs, vision, f"{path}:{line}")
            else:
                ids, labels = encode_chat(tok, msgs)
        except ConfigError:  # already names the file and line
            raise
        except ValueError as e:  # the template refused the conversation (raise_exception), or lost the answer
            raise ConfigError(f"{path}:{line}: {str(e).splitlines()[0]}") from None
        if len(ids) > max_length:
            if too_long == "skip":
                skipped.append(line)
                continue
            raise ConfigError(f"{path}:{line}: the conversation is {len(ids)} tokens, longer than the "
                              f"context of {max_length} (--max-length); shorten it, or pass --too-long skip "
                              f"to leave such records out")
        if all(x == IGNORE for x in labels[1:]):  # the model predicts labels[1:] (position 0 has no history)
            raise ConfigError(f"{path}:{line}: no assistant token to learn after rendering")
        out.append(Example(line, ids, labels, pixels))
    return out, skipped


# -- the batch source ---------------------------------------------------------------------------------------
class ChatData:
    """Trainer batch source: `batch(index, batch_size, split)` is a pure function of its arguments (the seed
    and the data), which is what makes --resume exact. Epoch e visits the examples in a permutation seeded by
    (seed, e); within windows of `window` batches the rows are sorted by length, so a batch holds rows of
    similar length; the batches of an epoch are then shuffled again."""

    metrics = {"loss": "min"}

    def __init__(self, train: list[Example], dev: list[Example], pad_id: int, seed: int = 0,
                 window: int = 16):
        if not train:
            raise ConfigError("no training examples left")
        self.train, self.dev, self.pad_id, self.seed, self.window = train, dev, pad_id, seed, window
        self._epochs: dict[tuple[int, int], list[list[int]]] = {}

    def _epoch(self, epoch: int, bs: int) -> list[list[int]]:
        key = (epoch, bs)
        if key not in self._epochs:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(len(self.train), generator=g).tolist()
            batches = []
            span = bs * self.window
            for s in range(0, len(order), span):
                chunk = sorted(order[s:s + span], key=lambda i: -len(self.train[i].input_ids))
                batches += [chunk[j:j + bs] for j in range(0, len(chunk), bs)]
            perm = torch.randperm(len(batches), generator=g).tolist()
            self._epochs = {key: [batches[i] for i in perm]}  # one epoch at a time is all a run needs
        return self._epochs[key]

    def batches_per_epoch(self, bs: int) -> int:
        return -(-len(self.train) // bs)

    def batch(self, index: int, batch_size: int, split: str = "train") -> dict[str, Tensor]:
        if split == "train":
            n = self.batches_per_epoch(batch_size)
            rows = [self.train[i] for i in self._epoch(index // n, batch_size)[index % n]]
        else:
            if not self.dev:
                raise ConfigError("no held-out data: pass --dev FILE")
            start = (index * batch_size) % len(self.dev)
            rows = self.dev[start:start + batch_size]
        return collate(rows, self.pad_id)


def collate(rows: list[Example], pad_id: int) -> dict[str, Tensor]:
    """Right-padded input_ids and labels (IGNORE on the padding); no attention mask (see the module
    docstring). Rows with images add pixel_values: every row's images, in row order (the order in which the
    model fills the placeholders)."""
    T = max(len(r.input_ids) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), T), IGNORE, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r.input_ids)] = torch.tensor(r.input_ids)
        labels[b, : len(r.labels)] = torch.tensor(r.labels)
    pixels = [r.pixel_values for r in rows if r.pixel_values is not None]
    return {"input_ids": ids, "labels": labels, **({"pixel_values": torch.cat(pixels)} if pixels else {})}


@torch.no_grad()
def assistant_loss(model: torch.nn.Module, examples: list[Example], pad_id: int,
                   batch_size: int = 8) -> float:
    """Mean cross-entropy per assistant token over `examples` (eval mode)."""
    was = model.training
    model.eval()
    total = n = 0.0
    device = next(model.parameters()).device
    for s in range(0, len(examples), batch_size):
        out = model(**{k: v.to(device) for k, v in collate(examples[s:s + batch_size], pad_id).items()})
        total += float(out.loss) * float(out.n_targets)
        n += float(out.n_targets)
    model.train(was)
    return total / max(n, 1.0)
