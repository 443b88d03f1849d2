"""Layer 4: plan sources — plans read from other libraries' declarations: Hugging Face's
``tp_plan``/``ep_plan`` (``hf``), ``parallelize_module`` dicts of torch and torchtitan
(``torch_styles``, ``torch_moe_styles``).  Imports ``core``, ``analysis`` and ``parallel``."""

__all__: list[str] = []
