"""Optional bridges to other libraries, imported only when used (``mhattn.integrations.transformers``)."""
