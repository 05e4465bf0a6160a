"""OpenAI's `service_tier` values, and the service class each one runs in; an answer echoes the tier of its class."""

from rqbatcher.service_class import BATCH, INTERACTIVE, PRIORITY

SERVICE_TIERS = {"auto": INTERACTIVE, "default": INTERACTIVE, "flex": BATCH, "priority": PRIORITY}
TIER_OF_CLASS = {PRIORITY: "priority", INTERACTIVE: "default", BATCH: "flex"}
