"""The tiny MoE model directory the CPU online test serves: a config and a tokenizer, no weights.

The config is Mixtral-shaped (vLLM treats it as MoE, so DP ranks run ``DPEngineCoreProc`` in
lockstep) like ``offline_vllm.write_tiny_model(moe=True)``, but the tokenizer is character-level
over printable ASCII: every JSON document is a token sequence, xgrammar reads the vocabulary as
raw strings, and decoding concatenates tokens, so the text the API returns is exactly what the
grammar accepted. Random prompts from ``vllm bench serve`` decode and re-encode to the same
length. Nothing is loaded from a model hub; the fake worker never reads weights.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from offline_vllm import tiny_model_config  # the same model shape as the unit tests' (pytest.ini's pythonpath)

SPECIALS = ["<pad>", "</s>", "<unk>"]
EOS_TOKEN_ID = 1
VOCAB = SPECIALS + [c for c in string.printable if c not in "\t\n\r\x0b\x0c"]
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"


def write_tiny_moe_model(directory: Path) -> Path:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    config = tiny_model_config(len(VOCAB), moe=True)
    (directory / "config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="</s>", unk_token="<unk>", pad_token="<pad>", chat_template=CHAT_TEMPLATE
    ).save_pretrained(directory)
    return directory
