"""Stored responses of OpenAI's Responses API (/v1/responses): what a response was asked, kept for its retention."""
