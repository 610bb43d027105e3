"""The serving engine: paged KV cache, the continuous-batching scheduler, generation, the token cache."""
