"""`python -m kernelgen`: the `kernelgen` command (pyproject.toml's entry point, kernelgen.cli:app)."""
from .cli import app

if __name__ == "__main__":
    app()
