"""An env of one's own for jaxrl_llm (the README's "Your own environment" section)."""
