"""The GPT model, its value paths and its derived sizes."""
