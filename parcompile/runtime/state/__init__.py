"""Model and optimizer state in and out: distributed checkpoints (DCP) saved and resumed, loaded safely, Hugging Face weights read and written."""
