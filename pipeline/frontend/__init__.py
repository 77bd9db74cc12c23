"""Text and images in, token ids out; ids back to text: the chat template and tokenizer, intake
(checked requests, image placeholders) and incremental detokenization."""
