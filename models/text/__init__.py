"""Text encoders that are not part of one model family: Qwen3-VL (the encoder H3 is conditioned on), its
tokenizer and the prompt layouts that put pictures and videos among the words."""
