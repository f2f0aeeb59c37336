from dflash.config.docs import options_markdown

print(options_markdown())
