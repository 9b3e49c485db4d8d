"""The Textual app. Talks to agents only through rankscope.wire.client."""
