"""Pipeline building blocks: bounded channels with explicit drop policies."""
