"""Model files written: the embedded tiny model, GGUF and safetensors checkpoints, quantized
forms. They use the foundation only, so any layer may make the model it defaults to."""
