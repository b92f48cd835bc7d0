"""kernelgen inside other libraries: `kernelgen.integrations.transformers` (Hugging Face transformers)."""
