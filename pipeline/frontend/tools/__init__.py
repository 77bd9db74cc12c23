"""Tool calling: a request's tools and tool_choice (``request``), each model family's call syntax and
the grammar that enforces it (``formats``), and the calls in OpenAI's shapes, whole and streamed
(``calls``)."""
