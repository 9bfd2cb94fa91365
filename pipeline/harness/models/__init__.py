"""The project's own tiny models and the chat formats they can be built with."""
