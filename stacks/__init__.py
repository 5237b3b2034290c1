"""CDK constructs and the gpuscout stack (one construct per file; gpuscout_stack.py composes and grants)."""
