"""Integrations with other libraries, each in its own module and imported on demand:
`memattn.integrations.hf` (Hugging Face transformers: memattn's models, and on import the
converted families of `.convert`), `.convert` (a pretrained transformers model's attention
replaced by a memattn mechanism), `.export` (`memattn export-hf`) and `.folders` (what a
folder memattn writes carries: model type, format, auto_map and `modeling_memattn.py`, a
model card). memattn itself never imports them."""
