"""OpenAI's Responses API (/v1/responses) format: its request body and response object (`responses_body`), its
input and output items (`response_items`), for the gateway and for batch lines alike."""
