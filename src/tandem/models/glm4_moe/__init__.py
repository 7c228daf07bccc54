"""GLM-4.5 / GLM-4.5-Air (transformers model type `glm4_moe`)."""
