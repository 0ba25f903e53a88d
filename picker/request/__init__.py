"""OpenAI-style request bodies: parsing (`openai`), the `openai-parser` plugin (`parser`),
errors as HTTP answers (`errors`), usage read from responses (`usage`) and the
`request-attribute-reporter` plugin, which reports values computed from it to the proxy
(`attribute_reporter`).

May import: framework (the request model and the plugin interfaces).
"""
