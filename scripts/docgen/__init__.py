"""The generated parts of docs/ (scripts/gen_docs.py writes and checks them), one module each:
configref (docs/config.md: every config key), exitcodes (docs/faults.md: every exit code),
commands (docs/commands.md: every command and option, from the CLI's own tree) and metrics
(docs/fleet.md: every family `/metrics` exports, scraped from a real `edge serve`). markdown
holds what they share: text from the code made into Markdown that renders as written."""
