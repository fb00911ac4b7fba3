"""The sample pipelines shipped with streamgrok (`streamgrok serve live_qa`)."""
