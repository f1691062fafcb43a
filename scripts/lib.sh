# Helpers shared by the protocol scripts (distillcache_*.sh, retrieval_*.sh); sourced, not run.
# They expect $py, the Python to run jaxkv with.

finished() {  # RESULT_JSON: true when that run wrote its results to the end
  grep -qs '"complete": true' "$1"
}

write_text() {  # DOMAIN PATH: jaxkv.rl.data's text of DOMAIN, tokenized as the embedded model's
  mkdir -p "$(dirname "$2")"
  "$py" -c "
from jaxkv.evals.runner import load_eval_model
from jaxkv.rl.data import write_domain_text
write_domain_text('$1', '$2', tokenizer=load_eval_model('smollm2-135m').tokenizer)"
}
