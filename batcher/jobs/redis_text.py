"""Redis replies as text. A client made with `decode_responses` answers str, one made without it answers bytes
(RQ needs bytes), and batcher's code takes either, through `as_text`."""


def as_text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
