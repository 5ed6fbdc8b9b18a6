"""`fmoe chat`. The defaults of the chat's own options (the command line and ChatOptions read them)."""

TEMPERATURE = 0.7  # 0: greedy
TOP_P = 0.9  # nucleus sampling threshold
MAX_NEW_TOKENS = 512  # the longest answer, in tokens
