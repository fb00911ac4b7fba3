"""Loading a model to run: GGUF files, Hugging Face folders and Hub names, with a
vision-language model's tower (`streamgrok.vision`) or a llama.cpp mmproj beside a text GGUF.
Above `streamgrok.model` (the decoder and its checkpoint readers) and `streamgrok.vision`
(the towers), which know nothing of each other's loading."""
