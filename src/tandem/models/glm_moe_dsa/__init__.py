"""GLM-5 (transformers model type `glm_moe_dsa`): MLA with DeepSeek sparse attention."""
