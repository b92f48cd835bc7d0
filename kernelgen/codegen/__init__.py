"""Kernel source: Jinja rendering of templates/ (`render`) and the content-addressed module cache (`cache`)."""
