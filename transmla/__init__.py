"""transmla: convert MHA/GQA checkpoints into Multi-head Latent Attention (MLA).

Importing the package registers the MLA model types with transformers' Auto classes, so a
converted checkpoint loads with AutoModelForCausalLM.from_pretrained(path).
"""

from .mla.model import register as _register

_register()

__version__ = "0.1.0"
