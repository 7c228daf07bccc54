"""A small tokenizer trained in-process, so tests and CPU examples need no download.

It is a byte-level BPE whose pre-tokenizer isolates every ASCII letter and digit: merges are
learned only among whitespace and punctuation, so a tiny model sees words letter by letter,
which is what character tasks (reversing, sorting, Wordle) need. Any UTF-8 text round-trips.
A few whole words (the chat roles and the reverse-text instruction, `WORD_TOKENS`) are single
tokens, as they would be in a real vocabulary; they match only as whole words, so a letter string
that merely contains one ("xtheq", "users") is still split into letters. This halves the length
of a reverse-text chat (68 → 35 tokens), which is most of what training on CPU costs.
The chat template is ChatML, as Qwen uses, with Qwen/Hermes-style tool rendering and Qwen3's
`enable_thinking = false` (an empty think block opens the answer).
"""

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

WORD_TOKENS = ["user", "assistant", "system", "tool", "Reverse", "the", "following", "text"]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]

CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "You may call one or more functions. Function signatures:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n"
    'Call a function as <tool_call>\n{"name": <name>, "arguments": <args>}\n</tool_call>'
    "<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}{% if not loop.first %}"
    "<|im_start|>system\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message.role }}\n{{ message.content if message.content else '' }}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}"
    "{% set fn = call.function if call.function else call %}"
    '\n<tool_call>\n{"name": "{{ fn.name }}", "arguments": '
    "{{ fn.arguments if fn.arguments is string else fn.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)

TRAINING_TEXT = [
    "Reverse the following text: ",
    "Sort these words alphabetically: ",
    "What is 12 + 34? Put the final answer in \\boxed{}.",
    "def solve(x: int) -> int:\n    return x * 2\n",
    '{"name": "calculator", "arguments": {"expression": "1 + 2"}}',
    "Guess the five-letter word. Feedback: G = green, Y = yellow, X = gray.\n\n",
    "The quick brown fox jumps over the lazy dog. 0123456789 ()[]{}<>,.;:!?'\"-_=+*/\\|@#$%^&~`",
]


def train_tokenizer(vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE described above and wrap it for transformers."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"[A-Za-z0-9]"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT * 4, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        additional_special_tokens=SPECIAL_TOKENS[1:2] + SPECIAL_TOKENS[3:],
    )
    wrapped.add_tokens([AddedToken(w, single_word=True, normalized=False) for w in WORD_TOKENS])
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped
