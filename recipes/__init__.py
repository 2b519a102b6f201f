"""DPO on DeepSpeed ZeRO-3 for long contexts: recipe schema, data, model building and the memory levers."""
