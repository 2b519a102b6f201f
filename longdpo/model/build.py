"""Model and tokenizer building: a local Hugging Face directory or a Hub id (resolved by `from_pretrained`, through
the Hugging Face cache), or a shipped architecture JSON + random init.

Random-init models are built with `from_config`, which transformers runs under DeepSpeed `zero.Init` whenever a
ZeRO-3 `DPOConfig` exists (HfDeepSpeedConfig is alive), so no rank ever materialises the whole 12B model.
"""

from __future__ import annotations

import json
import os
import re

import torch
from huggingface_hub import constants
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.integrations import is_deepspeed_zero3_enabled
from transformers.trainer_utils import set_seed

from longdpo.config import ModelArgs, RecipeError, resolve_path

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# A chat template for the byte tokenizer: every rendered prompt is a prefix of prompt+completion, as TRL needs.
BYTE_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# The families' real chat templates, verbatim from their instruct models' tokenizer_config.json
LLAMA3_CHAT_TEMPLATE = (  # meta-llama/Meta-Llama-3-8B-Instruct
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
CHATML_CHAT_TEMPLATE = (  # Qwen/Qwen2-7B-Instruct (ChatML, as Qwen2.5 and Qwen3 without tools or thinking)
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + "
    "message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MISTRAL_CHAT_TEMPLATE = (  # mistralai/Mistral-7B-Instruct-v0.1
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
# model.tokenizer value -> (pad, bos, eos, other special tokens, chat template)
BYTE_TOKENIZERS = {
    "byte": ("<pad>", "<s>", "</s>", ["<|system|>", "<|user|>", "<|assistant|>"], BYTE_CHAT_TEMPLATE),
    "byte-llama3": (
        "<|finetune_right_pad_id|>",
        "<|begin_of_text|>",
        "<|eot_id|>",
        ["<|start_header_id|>", "<|end_header_id|>", "<|end_of_text|>"],
        LLAMA3_CHAT_TEMPLATE,
    ),
    "byte-chatml": ("<|endoftext|>", None, "<|im_end|>", ["<|im_start|>"], CHATML_CHAT_TEMPLATE),
    "byte-mistral": ("<pad>", "<s>", "</s>", ["[INST]", "[/INST]"], MISTRAL_CHAT_TEMPLATE),
}


def build_byte_tokenizer(kind: str = "byte"):
    """A byte-level tokenizer built in code (no download): one token per UTF-8 byte, plus special tokens; `kind`
    picks the special tokens and chat template (BYTE_TOKENIZERS: generic, or a family's real template).

    One byte = one token makes exact-length synthetic pairs trivial (longdpo/data/synthetic.py)."""
    pad, bos, eos, others, template = BYTE_TOKENIZERS[kind]
    specials = [t for t in (pad, bos, eos, "<unk>", *others) if t]
    byte_chars = list(bytes_to_unicode().values())
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({ch: len(specials) + i for i, ch in enumerate(byte_chars)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=pad,
        bos_token=bos,
        eos_token=eos,
        unk_token="<unk>",
        additional_special_tokens=others,
    )
    tokenizer.chat_template = template
    return tokenizer


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def model_source(path_or_id: str) -> str:
    """A local directory (relative to the working directory or the repo), else the string as a Hub id."""
    local = resolve_path(path_or_id)
    return local if os.path.isdir(local) else path_or_id


def check_source(key: str, path_or_id: str, needs: str = "config") -> None:
    """A local directory must hold a model's config (for a model); a Hub id must resolve now (its config or tokenizer
    files only: no weights are fetched here), from the Hugging Face cache or the Hub. Else one line naming the fix."""
    local = model_source(path_or_id)
    if os.path.isdir(local):
        if needs == "config":  # its config only (no weights): a folder of something else fails here, not after
            try:
                AutoConfig.from_pretrained(local)
            except (OSError, ValueError) as error:
                raise RecipeError(
                    f"`{key}` {path_or_id!r} is a directory but not a saved model "
                    f"({str(error).strip().splitlines()[0]}); point it at a directory written by `save_pretrained`, "
                    "or a Hub id."
                ) from None
        return
    if not HUB_ID.match(path_or_id):
        raise RecipeError(
            f"`{key}` {path_or_id!r} is neither a local directory nor a Hugging Face Hub id "
            "(`owner/name`). Point it at a directory written by `save_pretrained`, or a Hub id."
        )
    try:
        (AutoConfig if needs == "config" else AutoTokenizer).from_pretrained(path_or_id)
    except (OSError, ValueError) as error:
        offline = (
            " (HF_HUB_OFFLINE=1 is set: only the local cache is read; unset it or download the model first "
            "with `huggingface-cli download`)"
            if constants.HF_HUB_OFFLINE
            else ""
        )
        reason = str(error).strip().splitlines()[0]
        raise RecipeError(
            f"`{key}` {path_or_id!r} is not a local directory and could not be loaded from the Hugging "
            f"Face cache ({constants.HF_HUB_CACHE}) or the Hub{offline}: {reason}"
        ) from None


def load_tokenizer(args: ModelArgs):
    source = args.tokenizer or args.name_or_path
    if source in BYTE_TOKENIZERS:
        tokenizer = build_byte_tokenizer(source)
    else:
        tokenizer = AutoTokenizer.from_pretrained(model_source(source))
    if args.chat_template:
        tokenizer.chat_template = read_chat_template(args.chat_template)
    return tokenizer


def read_chat_template(value: str) -> str:
    """`model.chat_template`: a Jinja file (.jinja / .j2 / .txt, relative to the working directory or the repo), or the
    template itself."""
    path = resolve_path(value)
    if "{" not in value and os.path.splitext(value)[1] in (".jinja", ".j2", ".txt"):
        if not os.path.isfile(path):
            raise RecipeError(
                f"`model.chat_template` file {value!r} does not exist; give a Jinja file or the template itself."
            )
        with open(path) as f:
            return f.read()
    if "{{" not in value and "{%" not in value:
        raise RecipeError(
            f"`model.chat_template` {value[:60]!r} is neither a .jinja file nor a Jinja template "
            "(no `{{ }}` or `{% %}` in it)."
        )
    return value


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def load_architecture(args: ModelArgs):
    """The transformers config of the model: from the architecture JSON or the model directory."""
    if args.architecture:
        with open(resolve_path(args.architecture)) as f:
            spec = json.load(f)
        spec = {k: v for k, v in spec.items() if not k.startswith("_")}  # "_comment" keys document the JSON
        config = AutoConfig.for_model(**spec)
    else:
        config = AutoConfig.from_pretrained(model_source(args.name_or_path))
    if args.num_hidden_layers is not None:
        config.num_hidden_layers = args.num_hidden_layers
    return config


def build_model(args: ModelArgs):
    """The policy (or an identical reference: same config, same seed) as a fresh CausalLM."""
    config = load_architecture(args)
    dtype = DTYPES[args.dtype]
    if args.architecture:
        set_seed(args.init_seed)
        # Without ZeRO-3 (whose zero.Init places shards itself), initialise straight on the GPU: a 12B random
        # init on CPU takes minutes, on the GPU seconds.
        on_gpu = torch.cuda.is_available() and not is_deepspeed_zero3_enabled()
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        with device:
            return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=args.attn_implementation)
    return AutoModelForCausalLM.from_pretrained(
        model_source(args.name_or_path),
        config=config,
        dtype=dtype,
        attn_implementation=args.attn_implementation,
    )


def check_model_args(args: ModelArgs) -> None:
    """Start-up checks of the model section (no model is loaded)."""
    if bool(args.name_or_path) == bool(args.architecture):
        raise RecipeError(
            "Set exactly one of `model.name_or_path` (a local model directory) or `model.architecture` "
            "(an architecture JSON for a random-init model)."
        )
    if args.name_or_path:
        check_source("model.name_or_path", args.name_or_path)
    if args.architecture and not os.path.isfile(resolve_path(args.architecture)):
        raise RecipeError(
            f"`model.architecture` {args.architecture!r} does not exist; use a JSON in recipes/architectures/."
        )
    if args.architecture and not args.tokenizer:
        raise RecipeError(
            "A random-init model has no tokenizer: set `model.tokenizer: byte` (or byte-llama3, "
            "byte-chatml, byte-mistral) or a tokenizer directory."
        )
    if args.tokenizer and args.tokenizer not in BYTE_TOKENIZERS:
        check_source("model.tokenizer", args.tokenizer, needs="tokenizer")
    source = args.tokenizer or args.name_or_path
    folder = model_source(source) if source not in BYTE_TOKENIZERS else None
    if folder and os.path.isdir(folder) and not any(os.path.exists(os.path.join(folder, f)) for f in TOKENIZER_FILES):
        key = "model.tokenizer" if args.tokenizer else "model.name_or_path"
        raise RecipeError(
            f"No tokenizer in {source!r} (`{key}`; none of {', '.join(TOKENIZER_FILES)}): set "
            "`model.tokenizer` to a tokenizer directory or Hub id (e.g. the base model's), or save the "
            "tokenizer there with `tokenizer.save_pretrained`."
        )
    if args.chat_template:
        read_chat_template(args.chat_template)
    if args.dtype not in DTYPES:
        raise RecipeError(f"`model.dtype` must be one of {', '.join(DTYPES)}, got {args.dtype!r}.")
    if args.attn_implementation not in ("sdpa", "eager", "flash_attention_2"):
        raise RecipeError(
            f"`model.attn_implementation` must be sdpa, eager or flash_attention_2, got {args.attn_implementation!r}."
        )
    if args.num_hidden_layers is not None and args.num_hidden_layers < 1:
        raise RecipeError(f"`model.num_hidden_layers` must be at least 1, got {args.num_hidden_layers}.")
