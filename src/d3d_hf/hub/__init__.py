"""Hub-ready drafter folders: model cards rendered from data, and `push_to_hub` that uploads a complete folder.

What a drafter folder holds (written by `drafter.save_pretrained(path, tokenizer=tok)`):

- `model.safetensors` (or shards + index) and `config.json` with `auto_map` (transformers);
- the remote-code bundle: `configuration_d3d.py`, `modeling_d3d.py` and every sibling file they import, directly or
  not (transformers copies them, following their relative imports, because the classes are registered with
  `register_for_auto_class`: no list of bundle files is kept here);
- tokenizer files when a tokenizer is given;
- `README.md`, the model card rendered from `hub_cards/drafter_card.md.jinja` by `render_model_card`, and
  `d3d_card_data.json`, the data it was rendered from (`DrafterCardData`). The card is regenerated from data, never
  hand-edited.

No `generation_config.json` is written: a drafter is never the model `generate` is called on (transformers'
`can_generate()` is `False` for it and no generation config is loaded for it); the decoding settings that matter are
the target's, and the drafter's own setting (block size) lives in `config.json`.

Where the card data lives: on the drafter object, as `drafter.card_data` (a `DrafterCardData` or a plain `dict` of
its fields), not in `config.json`: measured numbers describe one run on one machine, not the model, and they must
not change the model's config hash or leak into training checkpoints. `save_pretrained` writes the data next to the
card (`d3d_card_data.json`) so that a later `d3d-hf push` re-renders the same card; `load_card_data(folder)` reads it
back.

README rule: a `README.md` is written only if the folder has none, or has one carrying `CARD_MARKER` (a file
d3d-hf generated earlier). A user-written `README.md` is never replaced unless `overwrite=True` is passed to
`write_model_card`; the same holds for the README of an existing Hub repository in `push_drafter` (the Hub copy is
kept unless `overwrite_card=True`).

Front matter: `library_name: transformers`, `pipeline_tag: text-generation`, `tags` (`custom_code`,
`speculative-decoding`, `d3d`, ...), `base_model` (the autoregressive model the drafter was initialised from, only
when it is a Hub id: the Hub links lineage through it), `datasets`, and `target_model`. The Hub has no standard
field for "the model this drafter speculates for"; `base_model` would be wrong for it (lineage, and for a D3D-1.7B-8B
drafter the target is not what it was made from) and `base_model_relation` only knows adapter / merge / quantized /
finetune. The Hub keeps unknown front-matter keys as they are (as GGUF repositories do with `model_creator` or
`quantized_by`), so `target_model` is a custom key, named like the `D3DConfig` field it mirrors.
"""

from .card import (
    ARXIV_ID,
    CARD_MARKER,
    CARD_TEMPLATE,
    DEFAULT_TAGS,
    is_generated_card,
    render_model_card,
    write_model_card,
)
from .card_data import CARD_DATA_FILE, DrafterCardData, MeasuredResult, load_card_data, result_from_benchmark
from .push import push_drafter

__all__ = [
    "ARXIV_ID",
    "CARD_DATA_FILE",
    "CARD_MARKER",
    "CARD_TEMPLATE",
    "DEFAULT_TAGS",
    "DrafterCardData",
    "MeasuredResult",
    "is_generated_card",
    "load_card_data",
    "push_drafter",
    "render_model_card",
    "result_from_benchmark",
    "write_model_card",
]
