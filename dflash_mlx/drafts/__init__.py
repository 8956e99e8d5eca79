"""Where drafts come from: the DFlash drafter, its trees, prompt lookup, the datastore."""
