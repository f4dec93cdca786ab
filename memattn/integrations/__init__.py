"""Integrations with other libraries, each in its own module and imported on demand:
`memattn.integrations.hf` (Hugging Face transformers). memattn itself never imports them."""
