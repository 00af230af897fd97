"""mlx_serve: an asyncio-native, OpenAI-compatible LLM server for MLX that never goes zombie."""

__version__ = "0.1.0"
