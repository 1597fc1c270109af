"""Model families beyond Llama, one file each, and the registry that picks a checkpoint's class."""
