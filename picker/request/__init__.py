"""OpenAI-style request bodies: parsing (`openai`), the `openai-parser` plugin (`parser`),
errors as HTTP answers (`errors`) and usage read from responses (`usage`).

May import: framework (the request model and the Parser interface).
"""
