"""Tokenizers (through the `tokenizers` library) and chat templates (through `jinja2`).

Three sources build the same `Tokenizer` wrapper:
  * `Tokenizer.from_hf_dir`: a Hugging Face `tokenizer.json` (+ `tokenizer_config.json`,
    `generation_config.json` for special ids and the chat template);
  * `tokenizer_from_gguf_vocab`: the vocabulary, merges and chat template embedded in a
    GGUF file (byte-level BPE, `tokenizer.ggml.model == "gpt2"`);
  * `tiny_tokenizer`: a 512-id byte-level BPE learned in code from a fixed corpus, for tests.

Chat templates: `apply_chat_template` executes the checkpoint's own Jinja template in the
sandboxed environment `transformers` uses (trim_blocks, lstrip_blocks, loop controls,
`tojson`, `raise_exception`, `strftime_now` pinned to `TEMPLATE_DATE`), so the prompt equals
`transformers`' `apply_chat_template(..., tokenize=False)`, ChatML or not (checked for the
SmolLM2, Qwen2.5, Qwen3 and a Zephyr-style template in tests/models/test_tokenizer.py). Only
text messages are passed; multimodal content blocks and assistant-token masks are not
supported. Templates with a thinking switch (Qwen3) get `enable_thinking`, False unless the
tokenizer's `enable_thinking` says otherwise: the agent prompt then ends in Qwen3's empty
thinking block `<|im_start|>assistant\n<think>\n\n</think>\n\n` and the policy answers
directly (templates without the variable ignore it).
"""

from __future__ import annotations

import collections
import datetime
import functools
import json
import os

import gguf
import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
# Plain ChatML without a default system prompt: the template of the tiny test tokenizer,
# and of a checkpoint that ships none but has the ChatML tokens (what transformers used as
# its default template before 4.43).
CHATML_TEMPLATE = ("{% for message in messages %}"
                   "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
                   "{% endfor %}"
                   "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

# Qwen2's pre-tokenizer split (tokenizer.json of Qwen2/Qwen2.5); GGUF calls it pre="qwen2".
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


class Tokenizer:
  """A byte-level BPE tokenizer with the special ids and chat template the project needs.

  Attributes:
    eos_ids: ids that end a generation (`<|im_end|>`, `<|endoftext|>` and the declared eos).
    pad_id: id used for padding (never attended to: masks decide).
    bos_id: declared beginning-of-sequence id, or None. `encode` never adds it.
    vocab_size: number of ids the tokenizer knows (can be below the model's vocab_size).
    chat_template: the Jinja source `apply_chat_template` executes, or None when the
      checkpoint has none (then `CHATML_TEMPLATE` if the vocabulary has the ChatML tokens).
    enable_thinking: the template variable of that name (Qwen3's thinking switch; the
      config's `rollout.enable_thinking`), False by default: no reasoning block.
  """

  def __init__(self, tokenizer: tokenizers.Tokenizer, *, eos_ids, pad_id: int,
               bos_id: int | None = None, chat_template: str | None = None,
               enable_thinking: bool = False):
    self._tok = tokenizer
    self.enable_thinking = bool(enable_thinking)
    self.eos_ids = tuple(dict.fromkeys(int(i) for i in eos_ids))
    if not self.eos_ids:
      raise ValueError("Tokenizer: no end-of-sequence id found (expected <|im_end|> or an eos token).")
    self.pad_id = int(pad_id)
    self.bos_id = None if bos_id is None else int(bos_id)
    self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    if not chat_template and tokenizer.token_to_id(IM_START) is not None \
        and tokenizer.token_to_id(IM_END) is not None:
      chat_template = CHATML_TEMPLATE
    self.chat_template = chat_template or None

  @property
  def backend(self) -> tokenizers.Tokenizer:
    """The wrapped `tokenizers.Tokenizer`."""
    return self._tok

  def token_to_id(self, token: str) -> int | None:
    """The id of a token string (e.g. "<|im_end|>"), or None."""
    return self._tok.token_to_id(token)

  def encode(self, text: str) -> list[int]:
    """Token ids of `text`; special tokens written in the text (e.g. <|im_start|>) map to
    their ids; no BOS/EOS is added (chat templates carry their own markers)."""
    return self._tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids, skip_special_tokens: bool = True) -> str:
    """Text of `ids` (any int sequence or array)."""
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                          enable_thinking: bool | None = None) -> str:
    """The prompt text of `messages` ([{"role": ..., "content": ...}, ...]): the checkpoint's
    chat template executed with the variables transformers passes (`messages`,
    `add_generation_prompt`, `tools=None`, `documents=None` and the special-token strings
    `bos_token`, `eos_token`, `pad_token`), plus `enable_thinking` (default: the
    tokenizer's `enable_thinking`), as transformers passes its keyword arguments on."""
    if enable_thinking is None:
      enable_thinking = self.enable_thinking
    if self.chat_template is None:
      raise ValueError("apply_chat_template: this tokenizer has no chat template; add "
                       "`chat_template` to tokenizer_config.json (or use a chat/instruct checkpoint).")
    token = lambda i: None if i is None else self._tok.id_to_token(i)
    try:
      return _compile_chat_template(self.chat_template).render(
          messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
          tools=None, documents=None, bos_token=token(self.bos_id), eos_token=token(self.eos_ids[0]),
          pad_token=token(self.pad_id), enable_thinking=bool(enable_thinking))
    except jinja2.TemplateError as e:
      raise ValueError(f"apply_chat_template: the chat template failed: {e}") from None

  def token_strings(self, size: int | None = None) -> list[str]:
    """Decoded text of every token id 0..vocab_size-1 (special tokens as written).

    Byte-level tokens that hold part of a UTF-8 character decode to U+FFFD. With `size`
    (e.g. the model's vocab_size) the list is padded with "" for ids the tokenizer lacks.
    """
    strings = self._tok.decode_batch([[i] for i in range(self.vocab_size)],
                                     skip_special_tokens=False)
    if size is not None:
      strings += [""] * (size - len(strings))
    return strings

  # ---------------------------------------------------------------- constructors
  @classmethod
  def from_hf_dir(cls, directory: str) -> "Tokenizer":
    """From `tokenizer.json` (required) plus the optional tokenizer/generation configs."""
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(path):
      raise FileNotFoundError(f"{path} not found: the model directory needs the Hugging Face "
                              "tokenizer.json (save it with tokenizer.save_pretrained).")
    tok = tokenizers.Tokenizer.from_file(path)
    tok_cfg = _read_json(os.path.join(directory, "tokenizer_config.json"))
    gen_cfg = _read_json(os.path.join(directory, "generation_config.json"))
    token_id = lambda name: _special_id(tok, tok_cfg.get(name))
    eos = [token_id("eos_token")]
    gen_eos = gen_cfg.get("eos_token_id")
    eos += gen_eos if isinstance(gen_eos, list) else [gen_eos]
    eos += [tok.token_to_id(IM_END), tok.token_to_id(END_OF_TEXT)]
    eos = [i for i in eos if i is not None]
    pad = token_id("pad_token")
    pad = pad if pad is not None else (eos[0] if eos else 0)
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
      template = next((t["template"] for t in template if t.get("name") == "default"), "")
    jinja_path = os.path.join(directory, "chat_template.jinja")  # transformers >= 4.50 layout
    if not template and os.path.isfile(jinja_path):
      with open(jinja_path) as f:
        template = f.read()
    return cls(tok, eos_ids=eos, pad_id=pad, bos_id=token_id("bos_token"), chat_template=template)


class _GenerationTag(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): the body
  is rendered as is, since this project never asks for assistant masks."""
  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

  def _render(self, caller):
    return caller()


# The date `strftime_now` returns in chat templates (the fallback date of the Llama 3.1
# template, which it uses when `strftime_now` is undefined).
TEMPLATE_DATE = datetime.datetime(2024, 7, 26)


def _raise_exception(message):
  raise jinja2.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  # transformers' filter: Jinja's own tojson escapes HTML characters.
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compile_chat_template(source: str) -> jinja2.Template:
  """A chat template compiled in transformers' sandboxed environment (checkpoint
  templates are untrusted code)."""
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  # transformers passes today's date; a fixed one keeps prompts (Llama 3.x templates
  # write "Today Date: ...") and so runs identical on any day (docs/reproducibility.md).
  env.globals["strftime_now"] = lambda fmt: TEMPLATE_DATE.strftime(fmt)
  try:
    return env.from_string(source)
  except jinja2.TemplateSyntaxError as e:
    raise ValueError(f"chat template does not compile (line {e.lineno}: {e.message}); "
                     "fix chat_template in the checkpoint's tokenizer config.") from None


def _read_json(path: str) -> dict:
  if not os.path.isfile(path):
    return {}
  with open(path) as f:
    return json.load(f)


def _special_id(tok: tokenizers.Tokenizer, token) -> int | None:
  """Id of a special token given as a string or as {"content": ...} in tokenizer_config."""
  if isinstance(token, dict):
    token = token.get("content")
  return None if token is None else tok.token_to_id(token)


def byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
  """The pre-tokenizer of a byte-level BPE vocabulary by its GGUF `tokenizer.ggml.pre` name."""
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre == "smollm":  # digits one by one, then the GPT-2 regex
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
  if pre in ("gpt2", "default"):
    return byte_level
  if pre == "qwen2":
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  raise ValueError(f"GGUF tokenizer pre-tokenizer {pre!r} is not implemented "
                   "(supported: smollm, qwen2, gpt2); use the Hugging Face directory with tokenizer.json.")


def byte_level_bpe(vocab: list[str], merges: list[str], specials: list[str], pre: str) -> tokenizers.Tokenizer:
  """A `tokenizers` byte-level BPE from a token list (id = index), "a b" merges and specials."""
  bpe = models.BPE(vocab={t: i for i, t in enumerate(vocab)},
                   merges=[tuple(m.split(" ", 1)) for m in merges])
  tok = tokenizers.Tokenizer(bpe)
  tok.pre_tokenizer = byte_level_pre_tokenizer(pre)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([tokenizers.AddedToken(s, special=True, normalized=False) for s in specials])
  return tok


def tokenizer_from_gguf_vocab(tokens: list[str], merges: list[str], token_types: list[int], *,
                              model: str, pre: str, bos_id: int | None, eos_id: int | None,
                              pad_id: int | None, chat_template: str = "") -> Tokenizer:
  """A Tokenizer from GGUF `tokenizer.ggml.*` metadata (token_type 3 = control token)."""
  if model != "gpt2":
    raise ValueError(f"GGUF tokenizer model {model!r} is not implemented (only byte-level BPE, "
                     "'gpt2'); use a Hugging Face directory with tokenizer.json instead.")
  control = int(gguf.TokenType.CONTROL)
  specials = [t for t, kind in zip(tokens, token_types) if kind == control]
  tok = byte_level_bpe(tokens, merges, specials, pre)
  eos = [eos_id, tok.token_to_id(IM_END), tok.token_to_id(END_OF_TEXT)]
  eos = [i for i in eos if i is not None]
  return Tokenizer(tok, eos_ids=eos, pad_id=pad_id if pad_id is not None else eos[0],
                   bos_id=bos_id, chat_template=chat_template)


# -------------------------------------------------------------------- tiny tokenizer
TINY_SPECIALS = (END_OF_TEXT, IM_START, IM_END)
TINY_VOCAB_SIZE = 512

# Fixed training text of the tiny tokenizer: the kind of text the agents see (ALFWorld,
# WebShop, ChatML prompts), so test prompts stay short.
_TINY_CORPUS = """\
You are an expert agent operating in the ALFRED Embodied Environment. Your task is to:
put a clean apple in the fridge. You are in the middle of a room. Looking quickly around
you, you see a cabinet 1, a cabinet 2, a countertop 1, a countertop 2, a drawer 1, a
drawer 2, a fridge 1, a garbagecan 1, a microwave 1, a shelf 1, a sinkbasin 1, a
stoveburner 1, a toaster 1, and a diningtable 1. Your admissible actions of the current
situation are: go to cabinet 1, go to countertop 1, open fridge 1, close fridge 1, take
apple 1 from countertop 1, clean apple 1 with sinkbasin 1, heat egg 1 with microwave 1,
cool potato 1 with fridge 1, use desklamp 1, examine mug 1, look, inventory.
Nothing happens. You arrive at countertop 1. On the countertop 1, you see an apple 1, a
bread 1, a butterknife 1, a cup 2, a knife 1, a lettuce 1, a mug 1, a peppershaker 1, a
potato 1, a saltshaker 1, a spatula 1, a spoon 1, and a tomato 1. You pick up the apple 1
from the countertop 1. You open the fridge 1. The fridge 1 is open. In it, you see an egg 1.
You clean the apple 1 using the sinkbasin 1. You put the apple 1 in/on the fridge 1.
WebShop. Instruction: i need a long clear shower curtain, and price lower than 40.00
dollars. Search. Back to Search. Next >. < Prev. Buy Now. Description. Features. Reviews.
Attributes. search[long clear shower curtain] click[b09abc1234] click[buy now]
Page 1 (Total results: 50). Price: $19.99 to $39.99. size: small medium large x-large.
color: white black blue red green. Rating: 4.5 out of 5 stars.
You should first reason step-by-step about the current situation. This reasoning process
MUST be enclosed within <think> </think> tags. Once you've finished your reasoning, you
should choose an admissible action for current step and present it within <action>
</action> tags. Prior to this step, you have already taken 3 step(s). Below are the most
recent 2 observations and the corresponding actions you took.
system user assistant What is the capital of France? The capital of France is Paris.
Hello! How can I help you today? Thank you, that is correct. The answer is 42.
0 1 2 3 4 5 6 7 8 9 10 11 12 100 2024 3.14 = + - * / ( ) [ ] { } " ' : ; , . ! ?
Ünïcödé tëxt: café, naïve, 東京, привет, 🙂.
"""


def _byte_alphabet() -> list[str]:
  """The 256 printable characters that stand for bytes 0..255 in byte-level BPE (GPT-2)."""
  printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
               + list(range(ord("®"), ord("ÿ") + 1)))
  chars, extra = {}, 0
  for b in range(256):
    if b in printable:
      chars[b] = chr(b)
    else:
      chars[b] = chr(256 + extra)
      extra += 1
  return [chars[b] for b in range(256)]


def _learn_merges(words: collections.Counter, num_merges: int) -> list[str]:
  """Plain BPE training (Sennrich et al. 2016); ties go to the lexicographically smallest
  pair, so the result is the same in every process."""
  seqs = {w: list(w) for w in words}
  merges = []
  for _ in range(num_merges):
    pairs = collections.Counter()
    for w, count in words.items():
      s = seqs[w]
      for a, b in zip(s, s[1:]):
        pairs[(a, b)] += count
    if not pairs:
      break
    best = min(pairs, key=lambda p: (-pairs[p], p))
    merges.append(f"{best[0]} {best[1]}")
    for w, s in seqs.items():
      i, out = 0, []
      while i < len(s):
        if i + 1 < len(s) and (s[i], s[i + 1]) == best:
          out.append(s[i] + s[i + 1])
          i += 2
        else:
          out.append(s[i])
          i += 1
      seqs[w] = out
  return merges


@functools.lru_cache(maxsize=1)
def tiny_tokenizer() -> Tokenizer:
  """A deterministic 512-id byte-level BPE with ChatML specials (ids 0, 1, 2) for tests.

  Layout: 3 specials (<|endoftext|>, <|im_start|>, <|im_end|>), 256 byte tokens, then
  253 merges learned from a fixed corpus. Any text encodes (byte fallback by construction).
  """
  pre = "smollm"
  splitter = byte_level_pre_tokenizer(pre)
  words = collections.Counter(piece for piece, _ in splitter.pre_tokenize_str(_TINY_CORPUS))
  base = list(TINY_SPECIALS) + _byte_alphabet()
  merges = _learn_merges(words, TINY_VOCAB_SIZE - len(base))
  vocab = base + [m.replace(" ", "") for m in merges]
  assert len(set(vocab)) == TINY_VOCAB_SIZE, len(set(vocab))  # ids must be unique strings
  tok = byte_level_bpe(vocab, merges, list(TINY_SPECIALS), pre)
  return Tokenizer(tok, eos_ids=[vocab.index(IM_END), vocab.index(END_OF_TEXT)],
                   pad_id=vocab.index(END_OF_TEXT), bos_id=None, chat_template=CHATML_TEMPLATE)
