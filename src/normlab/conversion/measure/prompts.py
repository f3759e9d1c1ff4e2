"""The chat prompts a converted model is judged on (`normlab.conversion.measure.usage`): plain questions and requests
a user of an instruct model asks, written here. The judgement answers the first ``UsageConfig.prompts`` (24) of them;
``normlab evaluate --prompts 96`` answers all, for a chat score whose 95% interval is about half as wide. The first 24
are the ones every recorded chat score of the docs and bench/ was measured on: add new prompts after them. Below:
how they are put to a model (its chat template, greedy answers decoded together, within its positions).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["PROMPTS", "chat_prompts", "greedy_answers", "answer_tokens"]

PROMPTS = (
    "What is the capital of France?",
    "Explain what a neural network is in two sentences.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Give me three tips for sleeping better.",
    "What is the difference between weather and climate?",
    "Translate 'good morning' into Spanish.",
    "Write a Python function that returns the square of a number.",
    "Who wrote Romeo and Juliet?",
    "What is 12 times 7?",
    "Summarize the plot of Cinderella in one sentence.",
    "Why is the sky blue?",
    "Name three primary colors.",
    "What does a CPU do in a computer?",
    "Suggest a name for a pet goldfish.",
    "How do I boil an egg?",
    "What is photosynthesis?",
    "List the planets of the solar system.",
    "What is the boiling point of water in Celsius?",
    "Write a short thank-you note to a teacher.",
    "What is the largest ocean on Earth?",
    "Explain recursion to a child.",
    "What are the benefits of regular exercise?",
    "How does a rainbow form?",
    "What is the tallest mountain in the world?",
    "How many days are there in a leap year?",
    "Give me a synonym for 'happy'.",
    "What is the chemical symbol for gold?",
    "Write a limerick about a cat.",
    "How do vaccines work?",
    "What is the square root of 81?",
    "Name a famous painting by Leonardo da Vinci.",
    "What causes the seasons on Earth?",
    "Write a SQL query that counts the rows of a table named users.",
    "What is the main language spoken in Brazil?",
    "Give me two ideas for a rainy afternoon.",
    "How many continents are there?",
    "What does DNA stand for?",
    "Explain what inflation is in simple words.",
    "Who painted the ceiling of the Sistine Chapel?",
    "What is the freezing point of water in Fahrenheit?",
    "Write a two-line poem about autumn.",
    "How do bees make honey?",
    "What is the difference between a virus and a bacterium?",
    "Convert 5 kilometres to metres.",
    "What is the capital of Japan?",
    "Give me a tip for learning a new language.",
    "Why do cats purr?",
    "Write a JavaScript function that adds two numbers.",
    "Who was the first person to walk on the Moon?",
    "What is an adjective?",
    "How long does it take light from the Sun to reach Earth?",
    "Suggest a title for a mystery novel.",
    "What is the largest planet in the solar system?",
    "Explain what a black hole is.",
    "How many sides does a hexagon have?",
    "What is the opposite of 'ancient'?",
    "Describe the taste of a lemon.",
    "What is gravity?",
    "List three fruits that are red.",
    "How can I save money on groceries?",
    "What is 15 percent of 200?",
    "Who invented the telephone?",
    "Write a sentence using the word 'serendipity'.",
    "What is the longest river in Africa?",
    "Why do leaves change colour in autumn?",
    "What is a prime number?",
    "How do I make a cup of tea?",
    "Name three animals that live in the Arctic.",
    "What is the internet?",
    "Translate 'thank you' into French.",
    "What is the capital of Australia?",
    "Explain the water cycle in three steps.",
    "Write a short birthday message for a friend.",
    "How many bones are in the adult human body?",
    "What does a firefighter do?",
    "Why is exercise good for the heart?",
    "What is the speed of sound in air?",
    "Give me a fun fact about octopuses.",
    "What is a haiku?",
    "How do airplanes stay in the air?",
    "Name the three states of matter.",
    "Write a Python list of the first five even numbers.",
    "What is the smallest country in the world?",
    "Explain what a budget is.",
    "How many minutes are in a day?",
    "Who wrote 'Pride and Prejudice'?",
    "What is the main ingredient of guacamole?",
    "Describe a sunset in one sentence.",
    "What is the purpose of sleep?",
    "Suggest a healthy breakfast.",
    "What is the Great Wall of China?",
    "How do magnets work?",
    "What is 100 divided by 4?",
    "Write a polite email asking for a meeting.",
    "What is climate change?",
)


def chat_prompts(tokenizer: object, prompts: tuple[str, ...]) -> tuple[list[Tensor], str] | None:
    """The prompts through the chat template, and the text the template adds before the first user turn (its system
    prompt); None when the tokenizer has no chat template.

    Args:
        tokenizer: A transformers tokenizer.
        prompts: The user turns (`PROMPTS`).
    """
    if not getattr(tokenizer, "chat_template", None):
        return None
    ids, system = [], ""
    for p in prompts:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        system = text[: text.find(p)]
        ids.append(torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long))
    return ids, system


def greedy_answers(model: nn.Module, prompts: list[Tensor], new_tokens: int, eos: int | None) -> list[Tensor]:
    """Each prompt's greedy continuation (at most ``new_tokens`` ids, up to and with ``eos``), the prompts decoded
    together: left-padded to the longest, the padding masked. A decode step at batch 1 reads every weight for one
    token, so one prompt at a time cost a 0.5B model about 24 times the batch's decode time.

    Args:
        model: A causal LM with ``generate``.
        prompts: Token ids, each (T,).
        new_tokens: The most new tokens.
        eos: The end-of-sequence id, or None.
    """
    if not prompts:
        return []
    device = next(model.parameters()).device
    pad = eos if eos is not None else 0
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
    with torch.no_grad():
        g = model.generate(
            ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=pad,
        )[:, width:].cpu()
    out = []
    for row in g:
        ends = (row == eos).nonzero() if eos is not None else []
        out.append(row[: int(ends[0]) + 1] if len(ends) else row)  # the rows that ended early are padded after
    return out


def answer_tokens(prompts: list[Tensor], new_tokens: int, max_positions: int | None) -> int:
    """How many tokens the answers to ``prompts`` may take: ``new_tokens``, fewer where the longest prompt plus them
    would pass the model's ``max_positions`` (a GPT-2 of 128 positions: its position table ends there); 0 where the
    longest prompt alone fills them.

    Args:
        prompts: The prompts' token ids, decoded together (left-padded to the longest).
        new_tokens: The answers' length asked for.
        max_positions: The model's positions (``config.max_position_embeddings``), or None where unbounded.
    """
    if not max_positions:
        return new_tokens
    return max(0, min(new_tokens, max_positions - max(len(p) for p in prompts)))
